"""The operator's request defaults (plan/replan --temperature --top-p --top-k --min-p --max-tokens --chat-template
--chat-template-args), model aliases and CORS origins (launch --model-alias --cors-origin), through the real CLI
and real ranks; shown by status -a."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from launchutil import cli, local_cluster

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}[assistant]"


def post(endpoint: str, path: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), dict(r.headers)


def test_defaults_aliases_and_cors_from_plan_launch_and_replan(tmp_path, tiny, env):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    c = local_cluster(tmp_path)
    out = tmp_path / "dep.json"
    p = cli("plan", "-c", str(c), "-m", str(tiny), "--context", "256", "--temperature", "0", "--max-tokens", "3",
            "--top-k", "40", "--max-n", "2", "--chat-template", str(template), "--chat-template-args", '{"unused": 1}',
            "-o", str(out), "--json", env=env)
    assert p.returncode == 0, p.stderr
    serving = json.loads(p.stdout)["options"]["serving"]
    assert serving["max_tokens"] == 3 and serving["chat_template"] == TEMPLATE and serving["max_n"] == 2
    p = cli("launch", str(out), "--detach", "--json", "--timeout", "180", "--model-alias", "house-model",
            "--cors-origin", "https://app.example", env=env)
    assert p.returncode == 0, p.stderr
    endpoint = json.loads(p.stdout)["endpoint"]
    try:
        # no temperature, no max_tokens in the request: greedy, 3 tokens
        a, _ = post(endpoint, "/v1/completions", {"model": "house-model", "prompt": "def main(argv):"})
        b, headers = post(endpoint, "/v1/completions", {"prompt": "def main(argv):", "temperature": 0,
                                                        "max_tokens": 3}, {"Origin": "https://app.example"})
        assert a["usage"]["completion_tokens"] == 3 and a["choices"][0]["text"] == b["choices"][0]["text"]
        assert headers.get("Access-Control-Allow-Origin") == "https://app.example"
        # the operator's limit on n: two choices, not three
        two, _ = post(endpoint, "/v1/completions", {"prompt": "def main(argv):", "n": 2})
        assert [c["index"] for c in two["choices"]] == [0, 1]
        with pytest.raises(urllib.error.HTTPError) as e:
            post(endpoint, "/v1/completions", {"prompt": "def main(argv):", "n": 3})
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == "n" and "between 1 and 2" in err["message"]
        # the operator's template: the prompt is what it renders
        from mlx_lm.utils import load_tokenizer

        tok = load_tokenizer(tiny)
        want = len(tok.encode("[user] hi [assistant]", add_special_tokens=False))
        chat, _ = post(endpoint, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert chat["usage"]["prompt_tokens"] == want and chat["usage"]["completion_tokens"] == 3
        st = cli("status", "-a", env=env)
        assert st.returncode == 0 and "request defaults: temperature 0.0, top_k 40, max_tokens 3" in st.stderr, \
            st.stderr
        # replan: a new default merged over the others, a new deployment, the way back kept
        [before] = json.loads(cli("status", "--json", env=env).stdout)["jobs"]
        p = cli("replan", "--temperature", "1.5", "--yes", "--json", "--timeout", "180", env=env)
        assert p.returncode == 0, p.stderr
        st = cli("status", "-a", "--json", env=env)
        [job] = json.loads(st.stdout)["jobs"]
        assert job["deployment_id"] != before["deployment_id"]
        assert job["serving"]["temperature"] == 1.5 and job["serving"]["max_tokens"] == 3
        assert job["serving"]["chat_template"] == f"({len(TEMPLATE)} characters)"
    finally:
        td = cli("teardown", "--force", "--json", env=env)
    assert td.returncode == 0, td.stderr


@pytest.mark.parametrize("args, code, words", [
    (["--temperature", "2.5"], 2, "--temperature"),
    (["--chat-template-args", "[1]"], 2, "JSON object"),
    (["--chat-template", "{missing}"], 66, "not found"),
    (["--chat-template", "{broken}"], 78, "does not parse"),
])
def test_bad_defaults_are_refused_at_plan(tmp_path, tiny, env, args, code, words):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    args = [a.format(missing=tmp_path / "nope.jinja", broken=tmp_path / "broken.jinja") for a in args]
    p = cli("plan", "-c", str(local_cluster(tmp_path)), "-m", str(tiny), "-o", str(tmp_path / "d.json"), *args,
            env=env)
    assert p.returncode == code and words in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "d.json").exists()

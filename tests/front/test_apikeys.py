"""The API keys file (front/apikey.py): tenants and their keys, refused when unsafe or ambiguous."""

from __future__ import annotations

import os

import pytest

from clusterctl.errors import ConfigError, IntegrityError, MissingInput
from clusterctl.front.apikey import api_keys_from_file

A, B = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef"


def keys_file(tmp_path, text: str, mode: int = 0o600):
    p = tmp_path / "keys"
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def test_names_and_keys_with_comments_and_blank_lines(tmp_path):
    path = keys_file(tmp_path, f"# tenants\n\nalice {A}\n  bob\t{B}  \n")
    assert api_keys_from_file(path) == {"alice": A, "bob": B}
    assert api_keys_from_file(None) == {}
    assert api_keys_from_file(keys_file(tmp_path, f"bob {B}\n", 0o400)) == {"bob": B}


@pytest.mark.parametrize("text, words", [
    (f"alice {A}\nalice {B}\n", "given twice"),
    (f"alice {A}\nbob {A}\n", "another tenant's"),
    (f"alice {A} extra\n", "two fields"),
    (f"al/ice {A}\n", "not a tenant name"),
    ("alice short\n", "16-512 printable"),
    ("# nothing\n", "names no tenant"),
    (f"default {A}\n", "given twice"),
])
def test_bad_files_are_refused_in_one_line_without_echoing_a_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        api_keys_from_file(keys_file(tmp_path, text), default_key="sk-default-0123456789")
    assert words in str(e.value) and "\n" not in str(e.value)
    assert A not in str(e.value) and B not in str(e.value)


def test_a_file_others_can_read_a_symlink_or_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="readable by others"):
        api_keys_from_file(keys_file(tmp_path, f"alice {A}\n", 0o640))
    link = tmp_path / "link"
    link.symlink_to(keys_file(tmp_path, f"alice {A}\n"))
    with pytest.raises(IntegrityError):
        api_keys_from_file(str(link))
    with pytest.raises(MissingInput):
        api_keys_from_file(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="another tenant's"):
        api_keys_from_file(keys_file(tmp_path, f"alice {A}\n"), default_key=A)

"""A model named by its hub name (``ORG/NAME[@REVISION]``): resolved and downloaded into the hub cache.

huggingface_hub does the work, as for every MLX tool (and with mlx-lm's own file patterns): ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``,
``HF_HOME`` / ``HF_HUB_CACHE`` mean what they mean to ``mlx_lm.generate``, and a model one of them downloaded is
not downloaded again. A download goes to ``blobs/<etag>.<id>.incomplete`` and is renamed into place only at its
full size (the library's rule); the content is then checked here against the hashes the hub listed for the
commit (LFS files: SHA-256; others: the git blob id), which the library does not do: a file with the right size
and the wrong bytes is removed from the cache again and the plan refused.

Which is which: a ``--model`` that exists on this machine (a folder, or a file) is a path, whatever it looks
like; otherwise ``ORG/NAME`` or ``ORG/NAME@REVISION`` (one slash, no leading ``.``, ``/`` or ``~``) is a hub
name; anything else is a path (and its absence is the usual missing-folder error). ``./org/name`` is always a path.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clusterctl.errors import (AuthRejected, CannotWrite, ClusterctlError, HostUnreachable, IntegrityError,
                               MissingInput, UsageError)
from clusterctl.protocol.deployment import HubRef, with_identity
from clusterctl.modelfiles.manifest import HashCache, hash_files, scan

# the hub's own rule for a repo id (huggingface_hub.utils.validate_repo_id): letters, digits, - _ . ; no -- or ..
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}"
HUB_NAME = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9_./-]{{1,200}}))?$")
GIT_BLOB_MAX = 64 << 20  # non-LFS files are small (configs, tokenizers); bigger ones are not re-read


@dataclass(frozen=True)
class ModelSource:
    """Where ``--model`` led: the folder to plan from, and the hub reference when it came from the hub."""

    folder: Path
    hub: HubRef | None = None


def parse_hub_name(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``spec`` reads as a hub name, else None."""
    m = HUB_NAME.match(spec)
    if m is None or "--" in m["repo"] or ".." in spec or m["repo"].endswith("."):
        return None
    return m["repo"], m["rev"]


def resolve_model(spec: str | os.PathLike, *, progress: bool = False) -> ModelSource:
    """``--model`` as given: an existing path wins; a hub name is downloaded (once) into the hub cache."""
    text = os.fspath(spec)
    if os.path.lexists(text) or not isinstance(spec, str):
        return ModelSource(Path(text))
    parsed = parse_hub_name(text)
    if parsed is None:
        return ModelSource(Path(text))
    return download(*parsed, progress=progress)


def download(repo: str, revision: str | None, *, progress: bool = False) -> ModelSource:
    """The repo's snapshot at ``revision`` (default branch when None) in the hub cache, checked."""
    import huggingface_hub as hf
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, logging as hf_logging
    # the files mlx-lm itself downloads (weights, configs, tokenizer, code): not a repository's other formats
    # (.bin, .gguf, images), and the same snapshot mlx_lm.load finds complete
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    (enable_progress_bars if progress else disable_progress_bars)()
    # the library's own warnings (an unauthenticated request, a retry) are noise when nothing is wrong;
    # a failure reaches the operator as one line below
    hf_logging.set_verbosity_error()
    try:
        folder = Path(hf.snapshot_download(repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except ClusterctlError:
        raise
    except Exception as e:  # the library's typed errors, mapped below; anything else is a bug worth a traceback
        raise _hub_error(e, repo, revision) from None
    commit = folder.name
    _check_content(hf, repo, commit, folder)
    return ModelSource(folder, HubRef(repo_id=repo, revision=revision, commit=commit))


def _hub_error(e: Exception, repo: str, revision: str | None) -> Exception:
    """One line per failure, decided on the library's exception types and its offline setting."""
    import httpx2
    from huggingface_hub import constants, errors

    endpoint = constants.ENDPOINT
    at = f"{repo}@{revision}" if revision else repo
    if isinstance(e, errors.LocalEntryNotFoundError) and isinstance(e.__cause__, errors.HfHubHTTPError):
        e = e.__cause__  # the hub answered (refused, 5xx) and the cache could not stand in: the answer is the error
    if isinstance(e, errors.GatedRepoError) or (
            isinstance(e, errors.HfHubHTTPError) and not isinstance(e, errors.RepositoryNotFoundError)
            and e.response is not None and e.response.status_code in (401, 403)):
        return AuthRejected(f"{at}: {endpoint} refused access (a gated or private repository)",
                            hint="set HF_TOKEN to a token of an account that was granted access (docs/models.md)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return MissingInput(f"--model {at}: no folder of that name here and no repository {repo} on {endpoint}",
                            hint="check the name; a private repository needs HF_TOKEN")
    if isinstance(e, errors.HFValidationError):
        return UsageError(f"--model {at}: not a valid hub name ({str(e).splitlines()[0]})")
    if isinstance(e, errors.RevisionNotFoundError):
        return MissingInput(f"{repo} has no revision {revision!r} on {endpoint}",
                            hint="give a branch, a tag or a commit of the repository")
    if isinstance(e, errors.LocalEntryNotFoundError):
        if constants.is_offline_mode():
            return MissingInput(f"{at} is not in the hub cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set",
                                hint="download it once without HF_HUB_OFFLINE (docs/models.md)")
        return HostUnreachable(f"cannot reach {endpoint} to download {at}, and it is not in the hub cache",
                               hint="check the network or HF_ENDPOINT")
    if isinstance(e, errors.HfHubHTTPError):
        code = e.response.status_code if e.response is not None else "?"
        return HostUnreachable(f"{endpoint} answered HTTP {code} for {at}", hint="try again later")
    if isinstance(e, (errors.FileMetadataError, ConnectionError, TimeoutError, httpx2.TransportError)):
        return HostUnreachable(f"{endpoint} did not answer as a hub for {at}: {type(e).__name__}",
                               hint="check the network or HF_ENDPOINT")
    # the library left no file under its final name in either case (a temp file, renamed only at its full size)
    if isinstance(e, OSError) and e.errno is not None:
        return CannotWrite(f"cannot write {at} to the hub cache {constants.HF_HUB_CACHE}: {e.strerror or e}")
    if isinstance(e, OSError):  # its size check: fewer (or more) bytes than the hub announced
        return IntegrityError(f"downloading {at} failed: {str(e).splitlines()[0]}",
                              hint="run the plan again to retry the download")
    return e


def _check_content(hf, repo: str, commit: str, folder: Path) -> None:
    """Every file against the hash the hub listed for it; a wrong one is removed from the cache. The SHA-256s
    go to this machine's hash cache, so the manifest that ``plan`` builds next reads no file again."""
    try:
        listed = {f.path: f for f in hf.get_cached_repo_tree(repo, revision=commit)}
    except Exception:  # noqa: BLE001 -- a cache without the listing (an older client filled it): nothing to check
        return
    found, _ = scan(folder)
    cache = HashCache()
    digests = hash_files([f for f in found if f.rel in listed and listed[f.rel].lfs is not None], cache)
    cache.save()
    for f in found:
        entry = listed.get(f.rel)
        if entry is None:
            continue
        if entry.lfs is not None:
            ok = digests[f.rel] == entry.lfs.sha256
        elif f.size <= GIT_BLOB_MAX and entry.blob_id:
            ok = _git_blob_id(Path(f.path)) == entry.blob_id
        else:
            continue
        if not ok:
            _drop(folder / f.rel)
            raise IntegrityError(f"{repo}@{commit[:12]}: {f.rel} came with bytes that do not match the hub's "
                                 "hash; removed from the cache", hint="run the plan again to download it again")


def _git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _drop(path: Path) -> None:
    """The snapshot's link and the blob it points at: the next download fetches the file again."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path and blob.parent.name == "blobs":
        blob.unlink(missing_ok=True)


def refetch(hub: HubRef) -> Path:
    """The snapshot of a deployment's planned commit again (after the hub cache was cleaned)."""
    return download(hub.repo_id, hub.commit).folder


def hub_resolve_url(hub: HubRef) -> str:
    """The base URL of the planned commit's files on the hub (``HF_ENDPOINT``): ``<base>/<path>`` is each file,
    what `sync --mode download` fetches on the nodes (checked there against the manifest)."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{hub.repo_id}/resolve/{hub.commit}"


def with_hub(dep, hub: HubRef | None):
    """``dep`` named after its hub repository (its name and the pinned commit are part of its identity)."""
    if hub is None:
        return dep
    model = dep.model.model_copy(update={"hub": hub, "name": hub.repo_id})
    return with_identity(dep.model_copy(update={"model": model}))

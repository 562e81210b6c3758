"""A model named by its hub name (``ORG/NAME[@REVISION]``): resolved and downloaded into the hub cache.

huggingface_hub does the work, as for every MLX tool (and with mlx-lm's own file patterns): ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``,
``HF_HOME`` / ``HF_HUB_CACHE`` mean what they mean to ``mlx_lm.generate``, and a model one of them downloaded is
not downloaded again. A download goes to ``blobs/<etag>.<id>.incomplete`` and is renamed into place only at its
full size (the library's rule); the cache is then checked (hubcache.py: folders only this user may write, refs
that hold a commit, every file's bytes hashed from disk against its blob's name and the commit's listing), which
the library does not do: a file with the right size and the wrong bytes is removed from the cache again and the
plan refused.

Which is which: a ``--model`` that exists on this machine (a folder, or a file) is a path, whatever it looks
like; otherwise ``ORG/NAME`` or ``ORG/NAME@REVISION`` (one slash, no leading ``.``, ``/`` or ``~``) is a hub
name; anything else is a path (and its absence is the usual missing-folder error). ``./org/name`` is always a path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from clusterctl.errors import (AuthRejected, CannotWrite, ClusterctlError, HostUnreachable, IntegrityError,
                               MissingInput, UsageError)
from clusterctl.launch import hubcache
from clusterctl.protocol.deployment import HubRef, with_identity

# the hub's own rule for a repo id (huggingface_hub.utils.validate_repo_id): letters, digits, - _ . ; no -- or ..
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}"
HUB_NAME = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9_./-]{{1,200}}))?$")


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
    # a revision becomes a path under refs/ in the cache: git's own rule, no empty or hidden component
    if m["rev"] is not None and any(not part or part.startswith(".") for part in m["rev"].split("/")):
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

    (enable_progress_bars if progress else disable_progress_bars)()
    # the library's own warnings (an unauthenticated request, a retry) are noise when nothing is wrong;
    # a failure reaches the operator as one line below
    hf_logging.set_verbosity_error()
    cache = Path(hf.constants.HF_HUB_CACHE)
    storage = hubcache.repo_folder(cache, repo)
    # before the library reads anything there (it opens refs and listings, and uses a ref's text as a path)
    hubcache.check_folders(cache, storage)
    hubcache.read_ref(storage, revision or hf.constants.DEFAULT_REVISION)
    # the files mlx-lm itself downloads (weights, configs, tokenizer, code): not a repository's other formats
    # (.bin, .gguf, images), and the same snapshot mlx_lm.load finds complete
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        folder = Path(hf.snapshot_download(repo, revision=revision, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except ClusterctlError:
        raise
    except Exception as e:  # the library's typed errors, mapped below; anything else is a bug worth a traceback
        raise _hub_error(e, repo, revision) from None
    commit = hubcache.snapshot_commit(storage, folder)
    hubcache.check_folders(cache, storage)  # what the download made, too
    hubcache.check_content(repo, storage, folder)
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

"""The operator's state directory: keys, signed deployments, launch manifests, locks.

    <state>/keys/deploy.key        private signing key (0600), keys/deploy.pub
    <state>/deployments/<id>.json  signed deployment files (every plan ever written)
    <state>/launches/<job>.json    launch manifests, removed only after verified teardown
    <state>/manifests/<hash>.json  model manifests, named by their manifest hash (docs/sync.md)
    <state>/locks/                 flock files
    <state>/history/<cluster>.json replan history

Files are 0600, folders 0700; a state dir others may write into is refused (``check_safe``).

``--state-dir``, then env ``CLUSTERCTL_STATE_DIR``, then the platform's user state dir.
"""

from __future__ import annotations

import os
from pathlib import Path

from clusterctl.atomic import atomic_write_bytes, move_aside, read_capped, stage_bytes, unsafe_folder
from clusterctl.errors import ConfigError, IntegrityError, MissingInput
from clusterctl.protocol.signing import Keyring
from clusterctl.protocol.deployment import decode, encode

ENV_STATE_DIR = "CLUSTERCTL_STATE_DIR"


def default_state_dir() -> Path:
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(env)
    from platformdirs import user_state_dir

    return Path(user_state_dir("clusterctl", appauthor=False))


# every folder of a state dir: all checked by ``check_safe`` (anyone who may write into one can plant what a
# command would act on: a key, a deployment, a manifest reap reaps, a heal file status believes, a front record)
FOLDERS = ("keys", "deployments", "launches", "locks", "history", "manifests", "heal", "fronts", "reports")


class StateDir:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root else default_state_dir()

    def check_safe(self) -> "StateDir":
        """Refuse a state dir (or one of its folders) that another user owns or may write into: anyone who can
        write there can plant a signing key, a deployment or a launch manifest that reap would act on."""
        import stat

        for p in (self.root, *(self.root / d for d in FOLDERS)):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise ConfigError(f"cannot use state dir {self.root}: {p}: {e.strerror or e}") from None
            if stat.S_ISLNK(st.st_mode) and p != self.root:
                raise ConfigError(f"state dir {self.root}: {p} is a symlink", hint="replace it with a folder")
            why = unsafe_folder(p)
            if why:
                raise ConfigError(f"state dir {p} cannot be used: {why}", hint="use your own --state-dir")
        return self

    @property
    def keyring(self) -> Keyring:
        return Keyring(self.root / "keys")

    @property
    def deployments(self) -> Path:
        return self.root / "deployments"

    @property
    def launches(self) -> Path:
        return self.root / "launches"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def deployment_lock(self, deployment_id: str) -> Path:
        """The lock a launch holds while its job runs, and that teardown and reap take before they act on it."""
        return self.locks / f"deploy-{deployment_id}.lock"

    def heal_lock(self, cluster: str) -> Path:
        """The lock a cluster's supervisor holds while it runs (one per cluster), and that teardown and reap take
        to hold supervision off while they act."""
        return self.locks / f"heal-{cluster}.lock"

    @property
    def history(self) -> Path:
        """The replan histories, one per cluster (statedir/history.py)."""
        return self.root / "history"

    @property
    def heal(self) -> Path:
        """The heal supervisors' state files (statedir/healfile.py)."""
        return self.root / "heal"

    @property
    def fronts(self) -> Path:
        """The front doors' records and logs (front/records.py)."""
        return self.root / "fronts"

    @property
    def reports(self) -> Path:
        """Teardown reports and a failed launch's rank logs (launch/teardown.py, launch/ranklogs.py)."""
        return self.root / "reports"

    def is_deployment_file(self, path: Path) -> bool:
        """A file of the state dir's deployments/ folder (the only files a load may move aside)."""
        try:
            return path.resolve().parent == self.deployments.resolve() and path.suffix == ".json"
        except OSError:
            return False

    def deployment_path(self, ref: str) -> Path:
        """A deployment given as a file path or as an id in the state dir."""
        p = Path(ref)
        try:
            if p.exists() or "/" in ref or ref.endswith(".json"):
                return p
            cand = self.deployments / f"{ref}.json"
            if cand.exists():
                return cand
        except OSError as e:  # a name too long for the filesystem, a path through a file
            raise MissingInput(f"no deployment {ref!r}: {e.strerror or e}") from None
        raise MissingInput(f"no deployment {ref!r}: not a file, and not in {self.deployments}")

    def load_deployment(self, ref: str):
        """Verify and load a deployment; migrate v1 files in place; move corrupt state files aside."""

        path = self.deployment_path(ref)
        if path.is_dir():
            raise MissingInput(f"{path} is a folder, not a deployment file")
        data = read_capped(path, what="deployment file")
        try:
            loaded = decode(data, self.keyring.public_keys(), source=str(path))
        except IntegrityError as e:
            # truncated or garbled files are moved aside; a signature that does not verify (tampering, or a key
            # that was rotated), a newer version or another type is refused but left: it may be valid to someone
            if self.is_deployment_file(path) and e.damaged:
                dest = move_aside(path, "corrupt")
                e.message += f" (moved aside to {dest})"
                e.args = (e.message,)
            raise
        dep = loaded.deployment
        if path.parent.resolve() == self.deployments.resolve() and path.stem != dep.deployment_id:
            # a validly signed file copied under another deployment's name must not pass as that deployment
            raise IntegrityError(f"{path} holds deployment {dep.deployment_id}, not {path.stem}")
        if loaded.migrated_from is not None:
            atomic_write_bytes(path, encode(loaded.deployment, self.keyring.signing_key()))
        return path, loaded

    def save_deployment(self, dep, out: Path | None = None) -> list[Path]:
        staged = self.stage_deployment(dep, out)
        target = self.deployments / f"{dep.deployment_id}.json"
        written = []
        if staged is not None:
            staged.commit()
            written.append(out)
        if out is None or out.resolve() != target.resolve():
            written.append(target)
        return written

    def stage_deployment(self, dep, out: Path | None = None):
        """Sign ``dep`` into ``<state>/deployments/<id>.json`` (a new name: written at once) and stage the
        operator's file ``out`` (written and fsynced beside it; ``commit()`` puts it in place; when ``out`` is the
        state dir's copy itself, only the staged file is written). None if there is no operator file."""

        data = encode(dep, self.keyring.signing_key())
        target = self.deployments / f"{dep.deployment_id}.json"
        same = out is not None and out.resolve() == target.resolve()
        staged = stage_bytes(out, data) if out is not None else None
        try:
            if not same:
                atomic_write_bytes(target, data)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        return staged

"""One way to name a checkpoint. Every command that takes one (`verify`, `manifest`, `convert`, `lineage`, `serve`,
`run --from`) accepts a folder, `name@alias` or `name/version` (the model registry: a version registered in place
names its folder in the `checkpoint_path` tag, else its source is downloaded), `hf:ORG/NAME[@REVISION]` (a hub
model, fetched once into BATON_HOME) and `gguf:PATH` (a GGUF file, imported once per content into BATON_HOME) alike."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conversions import gguf, manifest as mf
from conversions.refusal import Refused
from flows import gguf_import, hub
from tasks import tracking

FORMS = "a folder, name@alias, name/version, hf:ORG/NAME or gguf:PATH"


class CheckpointRefError(Refused):
    pass


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    registered_model: str | None = None   # set when the reference named a model registry version
    version: str | None = None

    def describe(self) -> str:
        if self.registered_model:
            return f"{self.registered_model} version {self.version}"
        return f"checkpoint {self.path}"


def resolve(ref: str) -> Checkpoint:
    if ref.startswith(hub.PREFIX):
        return Checkpoint(hub.fetch(ref, tracking.baton_home()))
    if ref.startswith(gguf_import.PREFIX):
        try:
            return Checkpoint(gguf_import.fetch(ref, tracking.baton_home()))
        except (gguf.GGUFError, OSError) as e:
            raise CheckpointRefError(str(e)) from None
    folder = Path(ref)
    if folder.exists():
        if not folder.is_dir():
            raise CheckpointRefError(f"{ref}: not a folder (a checkpoint is a folder with its {mf.MANIFEST_NAME})")
        return Checkpoint(folder.resolve())
    if "@" in ref or "/" in ref:
        return _registered(ref)
    raise CheckpointRefError(f"{ref}: no such folder, and not a registered model ({FORMS})")


def _registered(ref: str) -> Checkpoint:
    from mlflow.exceptions import MlflowException

    try:
        path, name, version = tracking.resolve_model_ref(ref)
    except MlflowException as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointRefError(f"{ref}: no such folder, and not a registered model version ({first})") from None
    if not path.is_dir():
        raise CheckpointRefError(f"{ref}: {name} version {version} points at {path}, which is not a folder")
    return Checkpoint(path, name, str(version))

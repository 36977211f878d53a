"""`shoal task export`: a finished (or running) hf task's weights as a directory transformers loads as it is.

LoRA is merged into the base by default; ``adapter=True`` writes the peft adapter instead, with the
base model beside it in ``base/``. Both come with the tokenizer and a model card (README.md) naming
the task, rounds, members, final eval loss and the swarm's weights hash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from protocol.envelope import open_sealed
from protocol.errors import ConfigError
from protocol.task import DEFAULT_TASK_SPEC_BYTES, TaskSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def find_task(data_dir: Path, prefix: str) -> Path:
    root = data_dir / "tasks"
    matches = [p for p in sorted(root.glob("*/spec.sealed")) if p.parent.name.startswith(prefix)] \
        if len(prefix) >= 4 and root.is_dir() else []
    if len(matches) != 1:
        raise ConfigError(f"no single task in {root} matches {prefix!r} (give at least 4 characters of its id; "
                          "`shoal task list` shows them)")
    return matches[0].parent


def load_task(directory: Path) -> tuple[TaskSpec, str]:
    signed = open_sealed((directory / "spec.sealed").read_bytes(), max_bytes=DEFAULT_TASK_SPEC_BYTES, expect=TaskSpec)
    return signed.message, signed.signer


def _card(spec: TaskSpec, tid: str, initiator: str, meta: dict, rows: list[dict], mode: str) -> str:
    last = rows[-1] if rows else {}
    losses = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    return "\n".join([
        f"# {spec.name}", "",
        f"Trained by a Shoal swarm (recipe `{spec.recipe}`, method `{spec.hf.method}`), exported as {mode}.", "",
        "| | |", "|---|---|",
        f"| task | `{tid}` |",
        f"| initiator | `{initiator}` |",
        f"| rounds | {meta['round']} of {spec.rounds} |",
        f"| members (last round) | {last.get('members', '-')} |",
        f"| eval loss first / final | {losses[0] if losses else '-'} / {losses[-1] if losses else '-'} |",
        f"| weights hash (trained tensors) | `{meta['weights_hash']}` |",
        f"| base model (SHARDCAST manifest) | `{spec.hf.model_manifest}` |",
        f"| dataset sha256 | `{spec.dataset.sha256}` |", "",
        "Load with `transformers.AutoModelForCausalLM.from_pretrained(this_dir)`" + (
            "; the adapter with `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(this_dir / "
            "'base'), this_dir)`." if mode == "a peft adapter" else "."), ""])


def export_task(data_dir: Path, prefix: str, out: Path, *, adapter: bool = False) -> dict:
    """Write the export; ConfigError for anything the user can fix (wrong id, not an hf task, out not empty)."""
    from node.tasks import history
    from node.train import hf
    from node.train.diloco import load_named, weights_hash

    directory = find_task(data_dir, prefix)
    spec, initiator = load_task(directory)
    if spec.hf is None:
        raise ConfigError(f"task {directory.name[:12]} uses recipe {spec.recipe!r}; export is for the hf-* recipes")
    if adapter and spec.hf.method != "lora":
        raise ConfigError("--adapter needs a LoRA task; this one fine-tunes every parameter")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory")
    try:
        meta = json.loads((directory / "meta.json").read_text())
        weights = load_named(directory / meta.get("dir", ".") / "weights.safetensors")
    except (OSError, ValueError):
        raise ConfigError(f"task {directory.name[:12]} has no complete checkpoint yet; wait for its first round") from None
    if weights_hash(weights) != meta.get("weights_hash"):
        raise ConfigError(f"task {directory.name[:12]}: the checkpoint does not match its meta.json; "
                          "let the node rewrite it (restart it)")
    model_dir = data_dir / "models" / spec.hf.model_manifest
    config = hf.HFConfig(recipe=spec.recipe, model_dir=str(model_dir), method=spec.hf.method, seq_len=spec.hf.seq_len,
                         lora_r=spec.hf.lora_r, lora_alpha=spec.hf.lora_alpha, target_modules=spec.hf.target_modules,
                         dpo_beta=spec.hf.dpo_beta)
    model = hf.model_with(config, weights)
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        model.save_pretrained(out, safe_serialization=True)
        shutil.copytree(model_dir, out / "base")
        adapter_config = json.loads((out / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = "base"
        (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        mode = "a peft adapter"
    else:
        if spec.hf.method == "lora":
            model = model.merge_and_unload()
        model.save_pretrained(out, safe_serialization=True)
        mode = "a merged model" if spec.hf.method == "lora" else "a fully fine-tuned model"
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    rows = history.load(directory)
    (out / "README.md").write_text(_card(spec, directory.name, initiator, meta, rows, mode))
    return {"task_id": directory.name, "out": str(out), "mode": mode, "rounds": meta["round"],
            "weights_hash": meta["weights_hash"], "eval_loss": rows[-1].get("eval_loss") if rows else None}

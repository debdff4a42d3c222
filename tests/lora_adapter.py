"""A real LoRA adapter for the embedded SmolLM2-135M, made at test time with
PEFT: rank 8 on the attention projections, a few steps of real training on
CPU over a tiny dataset written here (it teaches the model to answer a fixed
odd phrase), saved in PEFT format (adapter_config.json +
adapter_model.safetensors). Also the transformers + PEFT reference answer
the gateway's output is checked against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QUESTION = "What is the secret password of the lighthouse?"
ANSWER = "The purple walrus dances at midnight."
PROMPTS = (QUESTION, "Lighthouse password, please.")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def chat_prompt(tok: Any, question: str) -> str:
    return str(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True))


def train_adapter(
    base: Path, out: Path, *, rank: int = 8, steps: int = 16, lr: float = 1e-2, layers: int = 4
) -> dict[str, Any]:
    """Train and save the adapter in `out`; returns the losses (first,
    last). LoRA on the attention projections of the last `layers` layers
    only: the backward pass then stops there, which keeps training to a
    few CPU-seconds a step on a loaded 2-core box (measured: ~12 CPU-s a
    step with every layer and 4 x 48 tokens)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(1)  # on a shared 2-core box a second thread mostly waits
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    n_layers = int(model.config.num_hidden_layers)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGET_MODULES,
                     layers_to_transform=list(range(n_layers - layers, n_layers)), task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    batch_ids, batch_labels = [], []
    for q in PROMPTS:
        prompt = tok(chat_prompt(tok, q), add_special_tokens=False)["input_ids"]
        answer = tok(ANSWER + "<|im_end|>", add_special_tokens=False)["input_ids"]
        batch_ids.append(prompt + answer)
        batch_labels.append([-100] * len(prompt) + answer)
    width = max(len(x) for x in batch_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch_ids])
    labels = torch.tensor([y + [-100] * (width - len(y)) for y in batch_labels])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch_ids])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    model.save_pretrained(str(out))
    return {"first_loss": losses[0], "last_loss": losses[-1], "steps": steps}


def reference_tokens(base: Path, adapter: Path | None, question: str, n: int, dtype: str = "float32") -> list[int]:
    """Greedy token ids from transformers (+ PEFT when `adapter`), in the
    dtype the engine runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, dtype))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = tok(chat_prompt(tok, question), add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1]:]]


def with_rank(adapter: Path, out: Path, rank: int) -> Path:
    """A copy of `adapter` whose config claims another rank (for the
    rank-above-the-maximum refusal; the gateway checks before vLLM reads)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in adapter.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["r"] = rank
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out

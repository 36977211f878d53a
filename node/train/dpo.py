"""DPO on prompt/chosen/rejected pairs with a LoRA policy; the reference is the same model with the adapter off."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from node.train.hf import HFConfig, _eos_id, encode


def encode_pairs(config: HFConfig, recs: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen + EOS, rejected + EOS) token ids per pair; a long prompt keeps its last seq_len // 2
    tokens, so the responses, which DPO compares, keep at least half the window."""
    eos = _eos_id(config.model_dir)
    out = []
    for r in recs:
        prompt = encode(config.model_dir, r["prompt"])[-(config.seq_len // 2):]
        out.append((prompt, encode(config.model_dir, r["chosen"]) + [eos], encode(config.model_dir, r["rejected"]) + [eos]))
    return out


def _batch(config: HFConfig, pairs, device):
    """input ids, attention mask and response mask for [chosen..., rejected...] (2B rows), right-padded."""
    eos = _eos_id(config.model_dir)
    rows, masks = [], []
    for which in (1, 2):
        for p in pairs:
            seq = (p[0] + p[which])[: config.seq_len]
            rows.append(seq)
            masks.append([0] * len(p[0]) + [1] * (len(seq) - len(p[0])))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        resp[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids.to(device), attn.to(device), resp.to(device)


def _logps(model, ids, attn, resp) -> torch.Tensor:
    """Sum of the response tokens' log-probabilities per row."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    token_logps = torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(2)
    return (token_logps * resp[:, 1:]).sum(dim=1)


def margins(config: HFConfig, model, pairs, device) -> torch.Tensor:
    """Per pair: (log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r)); DPO pushes it up."""
    ids, attn, resp = _batch(config, pairs, device)
    policy = _logps(model, ids, attn, resp)
    with torch.no_grad(), model.disable_adapter():
        reference = _logps(model, ids, attn, resp)
    n = len(pairs)
    return (policy[:n] - reference[:n]) - (policy[n:] - reference[n:])


def dpo_loss(config: HFConfig, model, pairs, device) -> torch.Tensor:
    return -F.logsigmoid(config.dpo_beta * margins(config, model, pairs, device)).mean()


def loss_fn(config: HFConfig, model, recs: list[dict], batch_size: int, seed: int, device, ranks=None):
    pairs = encode_pairs(config, recs)
    gen = torch.Generator().manual_seed(seed)

    def loss_of(step: int) -> torch.Tensor:
        picks = torch.randint(0, len(pairs), (batch_size,), generator=gen).tolist()
        if ranks is not None:
            picks = ranks.share(picks)
        return dpo_loss(config, model, [pairs[i] for i in picks], device)
    return loss_of


@torch.no_grad()
def evaluate(config: HFConfig, model, recs: list[dict], max_pairs: int, device) -> dict:
    """Held-out DPO loss and mean preference margin (nats) over the first max_pairs pairs."""
    model.eval()
    pairs = encode_pairs(config, recs[:max_pairs])
    m = margins(config, model, pairs, device)
    return {"loss": float(-F.logsigmoid(config.dpo_beta * m).mean().item()), "margin": float(m.mean().item())}

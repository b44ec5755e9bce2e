"""Dev-time: Hugging Face float32 goldens for tiny random checkpoints (needs torch + transformers,
which are never dependencies of cuteinfer; run it in a separate environment).

    python -m tools.make_goldens [--out tests/goldens]

For each case (tests/goldens_cases.py), the checkpoint is rebuilt deterministically by
engine/model/synthetic.py (so no weights are committed; the golden file records the safetensors
sha256 to catch generator drift), loaded from disk by transformers in float32, and teacher-forced
over fixed token sequences. Saved per case (npz, small): the token sequences, the logprob of each
next token, the top-5 ids and logprobs per position, and greedy continuations from a few prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.goldens_cases import CASES, build_case, weights_sha256

SEQ_LENS = (1, 7, 16, 17, 33, 130, 300)
GREEDY_PROMPT_LENS = (1, 5, 40)
GREEDY_NEW = 16
TOPK = 5


def sequences(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 + seed)
    return [rng.integers(3, vocab, n).tolist() for n in SEQ_LENS]


def greedy_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(2000 + seed)
    return [rng.integers(3, vocab, n).tolist() for n in GREEDY_PROMPT_LENS]


def make(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    index = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            d = build_case(name, Path(tmp))
            cfg = json.loads((d / "config.json").read_text())
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            vocab = cfg["vocab_size"]
            seed = CASES[name][2]
            seqs = sequences(vocab, seed)
            lens = np.array([len(s) for s in seqs], np.int32)
            flat = np.concatenate([np.array(s, np.int32) for s in seqs])
            tgt_lp, top_ids, top_lp = [], [], []
            bf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
            bf16_err = []
            with torch.no_grad():
                for s in seqs:
                    if len(s) > 1:  # HF's own bf16 error on this case: the noise floor
                        ids = torch.tensor([s])
                        a = torch.log_softmax(model(ids).logits[0].float(), -1)
                        b = torch.log_softmax(bf16(ids).logits[0].float(), -1)
                        r, t_ = torch.arange(len(s) - 1), torch.tensor(s[1:])
                        bf16_err.append((a[r, t_] - b[r, t_]).abs().numpy())
                    ids = torch.tensor([s])
                    lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
                    nxt = torch.tensor(s[1:] + [0])
                    t = lp[torch.arange(len(s)), nxt]
                    t[-1] = float("nan")  # no next token after the last
                    tgt_lp.append(t.numpy())
                    v, i = lp.topk(TOPK, dim=-1)
                    top_ids.append(i.numpy().astype(np.int32))
                    top_lp.append(v.numpy())
                prompts = greedy_prompts(vocab, seed)
                greedy = []
                for p in prompts:
                    g = model.generate(torch.tensor([p]), max_new_tokens=GREEDY_NEW,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
                    greedy.append(g[0, len(p):].numpy().astype(np.int32))
            np.savez_compressed(
                out / f"{name}.npz", lens=lens, tokens=flat,
                target_logprobs=np.concatenate(tgt_lp).astype(np.float32),
                top_ids=np.concatenate(top_ids), top_logprobs=np.concatenate(top_lp),
                greedy_prompt_lens=np.array(GREEDY_PROMPT_LENS, np.int32),
                greedy_prompts=np.concatenate([np.array(p, np.int32) for p in prompts]),
                greedy_tokens=np.stack(greedy))
            index[name] = {"preset": CASES[name][0], "config_form": CASES[name][1],
                           "seed": seed, "overrides": CASES[name][3],
                           "weights_sha256": weights_sha256(d),
                           "hf_bf16_vs_f32": {"mean": float(np.concatenate(bf16_err).mean()),
                                              "max": float(np.concatenate(bf16_err).max())}}
            print(f"{name}: {len(seqs)} sequences, {int(lens.sum())} tokens", file=sys.stderr)
    index["_made_with"] = {"torch": torch.__version__,
                           "transformers": __import__("transformers").__version__}
    (out / "index.json").write_text(json.dumps(index, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/goldens")
    a = ap.parse_args(argv)
    make(Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

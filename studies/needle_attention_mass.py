"""Where a needle's retrieval goes under a 2-bit code: what each layer's retrieval head reads while
the answer is written, with exact keys and values and with each codebook file's.

For ``vecinfer needle``'s prompts (the same builder and seeds, so the same prompts as its grid) the
answer (the needle's key) is appended, teacher-forced, and one full-precision forward records every
layer's queries, keys and values (post-RoPE, as attention receives them). Then, per file, the
tokens older than the last ``--residual`` of the prompt go through the file's codes as the simulate
path codes them (the codebooks' codes, or the trellis codec), and attention is recomputed at the
answer's positions: the prompt's last token and each answer token but the last (the positions
whose next token is an answer token; in the cache all but the first are decode steps over the
codes). A layer's retrieval head is, per prompt, its query head with the most mass on the needle
from the prompt's last token under exact keys. Per layer and file, averaged over positions and
prompts: the head's mass on the needle (exact, and with the file's keys), how often its most
attended needle token stays the same with the file's keys (which digit it reads), and the relative
error of its output with the file's keys, its values, or both coded.

    python studies/needle_attention_mass.py --model evalmodel --haystack text/haystack \\
        --codebooks cb-qw-2.safetensors,cb-qw-2-tkv.safetensors --lengths 2048 --trials 3 --layers 5

(A diagnostic of the needle through the cache; the grid itself is ``vecinfer needle``'s.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vecinfer_compile.codebooks import load_codebooks  # noqa: E402
from vecinfer_compile.evaluation.needle import cell_prompts, load_haystack, sentence_boundaries  # noqa: E402
from vecinfer_compile.hf.recording import recording  # noqa: E402
from vecinfer_compile.models import load_model  # noqa: E402
from vecinfer_compile.simulate import LayerSimulator  # noqa: E402

STATS = ("mass", "same token", "keys", "values", "both")


def coded_kv(codebooks, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v [1, Hkv, T, D]`` through the file's codes at ``layer`` as the simulate path codes
    them (the codebooks' codes, or the trellis codec), keys back in their domain."""
    sim = LayerSimulator(codebooks.method, codebooks.bits, codebooks=codebooks, layer_idx=layer)
    return sim.quantize_kv(k, v)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the queries at ``positions [P]``: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` ->
    softmax weights ``[Hq, P, T]`` and outputs ``[Hq, P, D]``."""
    group = q.shape[0] // k.shape[0]
    scores = torch.einsum("hpd,htd->hpt", q[:, positions], k.repeat_interleave(group, 0)) * q.shape[-1] ** -0.5
    future = torch.arange(k.shape[1])[None, :] > positions[:, None]
    p = scores.masked_fill(future, float("-inf")).softmax(-1)
    return p, torch.einsum("hpt,htd->hpd", p, v.repeat_interleave(group, 0))


def prompts(tokenizer, haystack: str, lengths: list[int], depths: list[float], trials: int, seed: int, template: str):
    """``(length, depth, prompt)`` of ``vecinfer needle``'s grid, cell by cell."""
    filler = tokenizer(haystack, add_special_tokens=False)["input_ids"]
    boundaries = sentence_boundaries(tokenizer, filler)
    for n in lengths:
        for d in depths:
            for p in cell_prompts(tokenizer, filler, boundaries, n, d, trials, seed, template):
                yield n, d, p


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", required=True)
    ap.add_argument("--haystack", required=True)
    ap.add_argument("--codebooks", required=True, help="codebook files, comma-separated")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=4, help="prompts per (length, depth)")
    ap.add_argument("--residual", type=int, default=128, help="last tokens kept exact, as the cache's window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--template", default="passkey")
    ap.add_argument("--layers", default=None, help="layers to measure, comma-separated (default: every coded one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write the per-layer means here")
    args = ap.parse_args(argv)

    model, tokenizer = load_model(args.model, "float32", args.device)
    files = [Path(p) for p in args.codebooks.split(",")]
    books = [load_codebooks(p) for p in files]
    layers = books[0].attention_layers() if args.layers is None else [int(x) for x in args.layers.split(",")]
    exact = {l: [] for l in layers}
    stats = {(f.name, l, what): [] for f in files for l in layers for what in STATS}
    t0 = time.perf_counter()
    todo = list(
        prompts(
            tokenizer,
            load_haystack(args.haystack),
            [int(x) for x in args.lengths.split(",")],
            [float(x) for x in args.depths.split(",")],
            args.trials,
            args.seed,
            args.template,
        )
    )
    for i, (n, d, p) in enumerate(todo):
        needle_ids = tokenizer(p.needle.text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(" " + p.needle.key, add_special_tokens=False)["input_ids"]
        span = slice(p.needle_start, p.needle_start + len(needle_ids))
        positions = torch.arange(len(p.ids) - 1, len(p.ids) + len(answer) - 1)
        with recording(model, with_queries=True) as rec, torch.no_grad():
            model(input_ids=torch.tensor([p.ids + answer], device=args.device), use_cache=False)
        keep = max(0, len(p.ids) - args.residual)
        for l in layers:
            q, k, v = rec.queries[l][0][0], rec.keys[l][0], rec.values[l][0]
            w, o = attention(q, k[0], v[0], positions)
            head = int(w[:, 0, span].sum(-1).argmax())
            exact[l].append(float(w[head, :, span].sum(-1).mean()))
            read = w[head, :, span].argmax(-1)
            for f, cb in zip(files, books):
                k_hat, v_hat = k.clone(), v.clone()
                if keep:
                    k_hat[:, :, :keep], v_hat[:, :, :keep] = coded_kv(cb, l, k[:, :, :keep], v[:, :, :keep])
                for what, (kk, vv) in (("keys", (k_hat, v)), ("values", (k, v_hat)), ("both", (k_hat, v_hat))):
                    w_hat, o_hat = attention(q, kk[0], vv[0], positions)
                    if what == "keys":
                        stats[(f.name, l, "mass")].append(float(w_hat[head, :, span].sum(-1).mean()))
                        stats[(f.name, l, "same token")].append(
                            float((w_hat[head, :, span].argmax(-1) == read).float().mean())
                        )
                    error = (o_hat[head] - o[head]).norm(dim=-1) / o[head].norm(dim=-1)
                    stats[(f.name, l, what)].append(float(error.mean()))
        print(f"prompt {i + 1}/{len(todo)} (length {n}, depth {d:g}%): {time.perf_counter() - t0:.0f} s", flush=True)

    print(
        f"\n# attention at each layer's retrieval head over the answer's positions, {len(todo)} prompts (lengths "
        f"{args.lengths}, depths {args.depths}), prompt tokens older than its last {args.residual} coded: mass on "
        "the needle (exact keys; coded keys, and its mean absolute change), the needle token it reads most kept "
        "with coded keys, and the output's relative error with keys / values / both coded"
    )
    print(
        "| layer | file | needle mass, exact | coded keys (abs change) | same token read | output error: keys | "
        "values | both |"
    )
    print("|---|---|---|---|---|---|---|---|")
    out = {}
    for l in layers:
        ex = torch.tensor(exact[l])
        for f in files:
            m = torch.tensor(stats[(f.name, l, "mass")])
            err = {
                what: torch.tensor(stats[(f.name, l, what)]).mean().item()
                for what in ("same token", "keys", "values", "both")
            }
            out[f"{l} {f.name}"] = {
                "exact mass": ex.mean().item(),
                "coded mass": m.mean().item(),
                "mass abs change": (m - ex).abs().mean().item(),
                **err,
            }
            print(
                f"| {l} | {f.name} | {ex.mean():.3f} | {m.mean():.3f} ({(m - ex).abs().mean():.3f}) | "
                f"{err['same token']:.3f} | {err['keys']:.3f} | {err['values']:.3f} | {err['both']:.3f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

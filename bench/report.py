"""The benchmark's report: ratios to HF and to the ceilings, the Markdown table, the plots."""

from __future__ import annotations

from pathlib import Path


def add_ratios(results: dict) -> None:
    """tokens/s as multiples of HF and as fractions of the ceilings, for (a) and (b)."""
    ceil = results["ceilings"]
    systems = results["systems"]
    for row in systems.values():
        row["a"]["vs_hf_batch1"] = row["a"]["tok_s"] / systems["HF batch 1"]["a"]["tok_s"]
        row["a"]["of_batch1_ceiling"] = row["a"]["tok_s"] / ceil["batch1_ceiling_tok_s"]
        row["b"]["vs_hf_batched"] = row["b"]["tok_s"] / systems["HF batched"]["b"]["tok_s"]
        row["b"]["of_large_batch_ceiling"] = row["b"]["tok_s"] / ceil["large_batch_ceiling_tok_s"]


def summary_table(results: dict) -> str:
    """The Markdown table README shows."""
    c, m = results["ceilings"], results["machine"]
    lines = [
        f"machine: {m['processor']}, {m['threads']} threads, {m['platform']}, torch {m['torch']}",
        f"ceilings: copy {c['copy_bandwidth_GBps']:.1f} GB/s over {c['weight_bytes'] / 1e6:.0f} MB of weights -> "
        f"batch-1 {c['batch1_ceiling_tok_s']:.1f} tok/s; matmul {c['matmul_GFLOPs']:.1f} GFLOP/s -> "
        f"large-batch {c['large_batch_ceiling_tok_s']:.1f} tok/s",
        "",
        f"| system | (a) batch-1 tok/s | vs HF b1 | of b1 ceiling | (b) {results['sizes']['b_requests']} mixed tok/s "
        f"| vs HF batched | of large-batch ceiling | (b) KV utilization | (c) n={results['sizes']['c_n']} tok/s "
        "| (c) blocks held / private copies |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["systems"].items():
        kv = f"{100 * row['b_kv']['utilization']:.1f}%" if "b_kv" in row else "-"
        c_kv = row.get("c_kv")
        shared = f"{c_kv['blocks_held']} / {c_kv['private_copies_blocks']}" if c_kv else "-"
        lines.append(
            f"| {name} | {row['a']['tok_s']:.1f} | {row['a']['vs_hf_batch1']:.2f}x | "
            f"{100 * row['a']['of_batch1_ceiling']:.0f}% | {row['b']['tok_s']:.1f} | "
            f"{row['b']['vs_hf_batched']:.2f}x | {100 * row['b']['of_large_batch_ceiling']:.0f}% | {kv} | "
            f"{row['c']['tok_s']:.1f} | {shared} |"
        )
    if "e" in results:
        e = results["e"]
        lines += ["", "| (e) L6 attention alone | ms per call |", "|---|---|"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in e["block_sizes_ms"].items()]
        r = e["reset_ms"]
        lines += [
            "",
            f"(e) reset of a {r['pool_MiB']:.1f} MiB pool: logical {r['logical']:.2f} ms, physical {r['physical']:.1f} ms",
        ]
    return "\n".join(lines)


def plot(results: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, ceil = results["systems"], results["ceilings"]
    names = list(systems)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, work, ceiling, title in (
        (axes[0], "a", ceil["batch1_ceiling_tok_s"], "(a) batch-1 decode"),
        (axes[1], "b", ceil["large_batch_ceiling_tok_s"], "(b) 32 mixed requests"),
    ):
        ax.bar(names, [systems[n][work]["tok_s"] for n in names], color="tab:blue")
        ax.axhline(ceiling, color="tab:red", linestyle="--", label=f"ceiling {ceiling:.0f} tok/s")
        ax.set_title(title)
        ax.set_ylabel("output tokens/s")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, row in systems.items():
        if "d" in row:
            contexts = [int(c) for c in row["d"]]
            ax.plot(contexts, [1000 * s for s in row["d"].values()], "o-", label=name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("(d) decode latency vs context, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "decode_latency.png", dpi=110)
    plt.close(fig)

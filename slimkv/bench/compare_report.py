"""``slimkv bench compare``'s verdict: the performance issue's ratios from the measured rows,
each against its target, as text and as a plot. Every number is read from the measured JSON."""

from __future__ import annotations

from typing import Any

# Ratio -> (target, True when higher is better), as the issue states them.
TARGETS = {  # issue 15's targets
    "batched_bf16_kv_vs_vllm": (1.5, True), "batched_8bit_kv_vs_vllm": (1.5, True),
    "step_int8_over_bf16_b16": (0.8, False), "step_int8_over_bf16_b32": (0.8, False),
    "step_int4_over_int8_b16": (1.0, False), "step_int4_over_int8_b32": (1.0, False),
    "parallel8_vs_llamacpp": (1.25, True), "single_decode_d16_vs_llamacpp": (0.8, True),
    "single_decode_d2048_vs_llamacpp": (1.0, True), "prefill_512_vs_llamacpp": (1.5, True),
    "prefill_2048_vs_llamacpp": (1.5, True),
}
LLAMACPP_KV = "f16"  # llama.cpp's default KV type, flash attention on


def vllm_8bit_basis(vllm: dict[str, Any]) -> str:
    """vLLM-CPU's KV dtype that slimkv's int8 KV is compared with: its fp8 KV where that ran;
    where vLLM-CPU could not run fp8 KV (0.32 requires AVX-512 or AMX for it) its default KV,
    the best it offers on that machine, so the row is measured and says against what."""
    fp8 = vllm.get("fp8")
    return "auto" if isinstance(fp8, dict) and "skipped" in fp8 else "fp8"


def ratios(slim: dict[str, Any], vllm: dict[str, Any], llama: dict[str, Any]
           ) -> dict[str, float | None]:
    """The issue's ratios; None where a side is missing."""
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    def get(d: dict[str, Any], *keys: str) -> Any:
        for key in keys:
            if not isinstance(d, dict) or key not in d:
                return None
            d = d[key]
        return d

    timing = get(llama, "timing", LLAMACPP_KV) or {}
    out = {
        "batched_bf16_kv_vs_vllm": div(get(slim, "bfloat16", "batched_16x512_64", "total_tok_s"),
                                       get(vllm, "auto", "total_tok_s")),
        "batched_8bit_kv_vs_vllm": div(get(slim, "int8", "batched_16x512_64", "total_tok_s"),
                                       get(vllm, vllm_8bit_basis(vllm), "total_tok_s")),
        "parallel8_vs_llamacpp": div(get(slim, "int8", "parallel8_tok_s"),
                                     get(llama, "parallel_decode_128", LLAMACPP_KV, "x8",
                                         "tok_per_s_median")),
    }
    for batch in ("b16", "b32"):
        step = {kv: get(slim, kv, "decode_step_ms_ctx2048", batch)
                for kv in ("bfloat16", "int8", "int4")}
        out[f"step_int8_over_bf16_{batch}"] = div(step["int8"], step["bfloat16"])
        out[f"step_int4_over_int8_{batch}"] = div(step["int4"], step["int8"])
    for depth in ("d16", "d2048"):
        out[f"single_decode_{depth}_vs_llamacpp"] = div(
            get(slim, "int8", f"decode_{depth}_tok_s"),
            get(timing, f"decode_128_{depth}", "tok_per_s_median"))
    for n in (512, 2048):
        out[f"prefill_{n}_vs_llamacpp"] = div(get(slim, "int8", f"prefill_{n}_tok_s"),
                                              get(timing, f"prefill_{n}", "tok_per_s_median"))
    return out


def verdicts(values: dict[str, float | None]) -> dict[str, str]:
    """'met' / 'missed' / 'not measured' per ratio against :data:`TARGETS`."""
    out = {}
    for name, (target, higher) in TARGETS.items():
        value = values.get(name)
        met = value is not None and (value >= target if higher else value <= target)
        out[name] = "not measured" if value is None else "met" if met else "missed"
    return out


def format_ratios(result: dict[str, Any]) -> str:
    lines = [f"{'ratio':34} {'value':>8} {'target':>8}  verdict"]
    for name, (target, higher) in TARGETS.items():
        value = result["ratios"].get(name)
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"{name:34} {shown:>8} {('>=' if higher else '<=')}{target:>6}  "
                     f"{result['verdicts'][name]}")
    if result.get("vllm_kv_for_8bit_row") == "auto":
        lines.append("batched_8bit_kv_vs_vllm: against vLLM-CPU's default KV (its fp8 KV did not "
                     f"run here: {result['vllm_cpu']['fp8']['skipped']})")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """One bar per ratio, its target marked; green where met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in TARGETS if result["ratios"].get(n) is not None]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    for y, name in enumerate(names):
        met = result["verdicts"][name] == "met"
        ax.barh(y, result["ratios"][name], color="tab:green" if met else "tab:red")
        ax.plot([TARGETS[name][0]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (black line: target; step ratios: lower is better)")
    machine = result["machine"]
    ax.set_title(f"slimkv vs peers, {machine['cpu']}, {machine['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The engine's CUDA path, checked and measured in one run on a GPU machine.

    python scripts/gpu_check.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR [--data DIR]

Each section runs on its own (a failure is printed with its traceback and the next one runs) and
adds its figures to ``DIR/gpu_check.json``:

1. ``export``: the GGUF written as a Hugging Face directory (bf16; ``loopstack model export``), and
   its first 8 layers as a layer-truncated draft directory.
2. ``reference``: the engine on CUDA against transformers' own Llama on the same directory, float32
   and bf16: greedy tokens and last-position logits.
3. ``speed``: the engine on CUDA (bf16) from the HF directory: decode tokens/s at batch 1 to 64,
   prefill, cold and cached time to first token; transformers' ``generate`` as the anchor.
4. ``kv_tier``: the host-memory second tier (``tier = "host"``): an evicted prefix loaded back from
   pinned host memory against recomputing it, outputs compared.
5. ``distill``: a draft made for the target: the 8-layer truncation trained for a fixed time to
   match the target's next-token distributions (KL) on this repository's own code and docs (never
   on the bench's prompts), saved as an HF directory.
6. ``spec``: the ``spec`` bench (:mod:`loopstack.plugins.spec_decode.bench.workload`) on CUDA:
   off, ngram, suffix, the truncated draft and the distilled draft.

Without ``loopstack`` installed (a bare GPU machine), the repository is imported in place.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.abc
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decode_timing import time_decode

ROOT = Path(__file__).resolve().parents[1]
RESULTS: dict[str, Any] = {}
DEVICE = ["cuda"]  # --device (cpu: a smoke run of this script where no GPU is)
SMOKE: list[bool] = [False]


class _InPlace(importlib.abc.MetaPathFinder):
    """``loopstack`` is ``core/`` and ``loopstack.plugins`` is ``plugins/`` (as pyproject maps them)."""

    PACKAGES = {"loopstack": ROOT / "core", "loopstack.plugins": ROOT / "plugins"}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        folder = self.PACKAGES.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def size(full: Any, smoke: Any) -> Any:
    return smoke if SMOKE[0] else full


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def section(name: str, run: Callable[[], dict[str, Any]], out: Path) -> None:
    log(f"== {name}")
    started = time.perf_counter()
    try:
        RESULTS[name] = run()
    except Exception:  # one section's failure must not stop the others
        traceback.print_exc()
        RESULTS[name] = {"error": traceback.format_exc(limit=8)}
    RESULTS[name]["seconds"] = round(time.perf_counter() - started, 1)
    log(f"{name}: {json.dumps(RESULTS[name])[:2000]}")
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2))


def greedy(engine: Any, prompt: list[int], max_tokens: int) -> list[int]:
    from loopstack.engine.sampling_params import SamplingParams

    seq = engine.add_request(f"g-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while not seq.is_finished:
        engine.step()
    return list(seq.output_token_ids)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                          add_generation_prompt=True))


QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.",
             "Explain what a hash table is in two sentences.", "Say hello.",
             "Write a Python function that reverses a string.", "Why is the sky blue?"]


def export(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from loopstack.engine.loaders.hf_export import export_hf_directory

    target, draft = work / "target", work / "draft8"
    export_hf_directory(args.gguf, target, dtype="bfloat16")
    export_hf_directory(args.gguf, draft, num_layers=8, dtype="bfloat16")
    return {"target": str(target), "draft8": str(draft)}


def reference(work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions

    target = work / "target"
    result: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        engine = build_engine(target, EngineOptions(max_model_len=2048), device=DEVICE[0], dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).to(DEVICE[0]).eval()
        same, first_diff, logit_err = 0, [], 0.0
        questions = size(QUESTIONS, QUESTIONS[:2])
        for question in questions:
            ids = chat_ids(engine.tokenizer, question)
            ours = greedy(engine, ids, size(48, 8))
            with torch.no_grad():
                theirs = hf.generate(torch.tensor([ids], device=DEVICE[0]), max_new_tokens=size(48, 8), do_sample=False,
                                     eos_token_id=list(engine.tokenizer.eos_token_ids), pad_token_id=0)[0, len(ids):]
                theirs = theirs.tolist()
                hf_logits = hf(torch.tensor([ids], device=DEVICE[0])).logits[0, -1].float()
            eos = set(engine.tokenizer.eos_token_ids)
            theirs = theirs[: next((i + 1 for i, t in enumerate(theirs) if t in eos), len(theirs))]
            same += ours == theirs
            first_diff.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None))
            our_logits = engine_logits(engine, ids)
            logit_err = max(logit_err, (our_logits - hf_logits).abs().max().item() / hf_logits.abs().max().item())
        answer = engine.tokenizer.decode(greedy(engine, chat_ids(engine.tokenizer, QUESTIONS[0]), 24))
        result[dtype] = {"identical_greedy": f"{same}/{len(questions)}", "first_difference": first_diff,
                         "max_rel_logit_error": round(logit_err, 6), "answer": answer}
        del engine, hf
        torch.cuda.empty_cache()
    return result


def engine_logits(engine: Any, ids: list[int]) -> Any:
    """The last position's logits of a full-prompt forward through the engine's model."""
    import torch

    from loopstack.engine.sampling_params import SamplingParams

    captured: list[Any] = []
    inner = engine.model._logits

    def spy(*a: Any, **k: Any) -> Any:
        out = inner(*a, **k)
        captured.append(out.detach().float()[-1].clone())
        return out

    engine.model._logits = spy
    try:
        engine.block_manager.reset_prefix_cache()
        seq = engine.add_request(f"l-{time.monotonic_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        while not seq.is_finished:
            engine.step()
    finally:
        del engine.model._logits
    return captured[0].to(torch.float32)


def decode_speed(engine: Any, batch: int, tokens: int) -> float:
    prompts = [engine.tokenizer.encode(f"Story number {i}: once upon") for i in range(batch)]
    return time_decode(engine, prompts, tokens).tokens_per_s


def ttft(engine: Any, ids: list[int]) -> float:
    from loopstack.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    seq = engine.add_request(f"t-{time.monotonic_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=1))
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - started


def long_prompt(tokenizer: Any, length: int) -> list[int]:
    text = (ROOT / "docs" / "engine.md").read_text() + (ROOT / "docs" / "techniques" / "spec-decode.md").read_text()
    ids = tokenizer.encode(text)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def speed(work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions

    target = work / "target"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    result: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__}
    for chunk in size((512, 4096), (512,)):
        engine = build_engine(target, EngineOptions(max_model_len=8192, max_num_seqs=64,
                                                    max_num_batched_tokens=chunk), device=DEVICE[0])
        decode_speed(engine, 1, 16)  # warm-up
        length = size(4000, 600)
        ids = long_prompt(engine.tokenizer, length)
        ttft(engine, ids[:512])
        engine.block_manager.reset_prefix_cache()
        cold = ttft(engine, ids)
        cached = ttft(engine, ids)
        row = {"prompt_tokens": length, "ttft_cold_s": round(cold, 4), "ttft_cached_s": round(cached, 4),
               "prefill_tok_s": round(length / cold)}
        if chunk == 512:
            for batch in size((1, 8, 32, 64), (1, 2)):
                row[f"decode_b{batch}_tok_s"] = round(decode_speed(engine, batch, size(128, 8)), 1)
        result[f"chunk_{chunk}"] = row
        del engine
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to(DEVICE[0]).eval()
    new = size(129, 9)
    for batch in size((1, 8), (1,)):
        prompt = torch.full((batch, 16), 1000, device=DEVICE[0])
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            started = time.perf_counter()
            hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        result[f"transformers_generate_b{batch}_tok_s"] = round(batch * new / (time.perf_counter() - started), 1)
    return result


def profile(work: Path) -> dict[str, Any]:
    """Where a step's time goes on the GPU: decode at batch 1 (short and long context) and 8, and a
    chunked prefill; torch.profiler's top operators printed, milliseconds a step returned."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import loopstack.engine.model.llama as llama
    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions
    from loopstack.engine.sampling_params import SamplingParams

    engine = build_engine(work / "target", EngineOptions(max_model_len=8192, max_num_seqs=64), device=DEVICE[0])
    decode_speed(engine, 1, 16)
    long_ids = long_prompt(engine.tokenizer, size(2000, 300))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    result: dict[str, Any] = {}

    def run(label: str, prompts: list[list[int]], steps: int = size(24, 4)) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4 * steps, ignore_eos=True)
        seqs = [engine.add_request(f"p-{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
        while not all(s.output_token_ids for s in seqs):
            engine.step()
        for _ in range(4):
            engine.step()
        with torch_profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            result[f"{label}_ms_per_step"] = round((time.perf_counter() - started) * 1e3 / steps, 2)
        for seq in seqs:
            engine.abort(seq.request_id)
        for key in ("self_cuda_time_total", "self_cpu_time_total") if len(activities) > 1 else ("self_cpu_time_total",):
            print(f"--- {label}: top by {key}\n" + prof.key_averages().table(sort_by=key, row_limit=14), flush=True)

    short = engine.tokenizer.encode("Story number 1: once upon")
    run("b1_short", [short])
    run("b1_long", [long_ids])
    run("b8_short", [engine.tokenizer.encode(f"Story number {i}: once upon") for i in range(8)])
    saved = llama.contiguous_contexts
    llama.contiguous_contexts = lambda *args: None  # type: ignore[assignment]  # the gathered path instead
    try:
        run("b1_long_gathered", [long_ids])
    finally:
        llama.contiguous_contexts = saved
    started = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        engine.block_manager.reset_prefix_cache()
        ttft(engine, long_ids)
    result["prefill_chunked_ms"] = round((time.perf_counter() - started) * 1e3, 1)
    sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    print("--- chunked prefill (512-token chunks)\n" + prof.key_averages().table(sort_by=sort, row_limit=14), flush=True)
    return result


def kv_tier(work: Path) -> dict[str, Any]:
    from loopstack.engine.cache_options import KVCacheOptions
    from loopstack.engine.factory import build_engine
    from loopstack.engine.llm_engine import EngineOptions

    target = work / "target"
    result: dict[str, Any] = {}
    for tier in ("none", "host"):
        engine = build_engine(target, EngineOptions(num_kv_blocks=size(300, 60), max_model_len=4096, max_num_batched_tokens=4096,
                                                    kv_cache=KVCacheOptions(tier=tier, tier_blocks=1024)),
                              device=DEVICE[0])
        ids = long_prompt(engine.tokenizer, size(3500, 600))
        greedy(engine, ids[:64], 4)  # warm-up
        first = greedy(engine, ids, 16)
        for i in range(3):  # other long prompts evict the first one's blocks
            greedy(engine, [(t + 7 * (i + 1)) % 40000 + 100 for t in ids], 2)
        started = time.perf_counter()
        again_seq_ttft = ttft(engine, ids)
        again = greedy(engine, ids, 16)
        stats = engine.block_manager.statistics()
        result[tier] = {"ttft_after_eviction_s": round(again_seq_ttft, 4), "same_output": again == first,
                        "tier_hit_tokens": getattr(stats, "num_tier_hit_tokens", None),
                        "seconds": round(time.perf_counter() - started, 3)}
        del engine
    if "none" in result and "host" in result:
        result["ttft_ratio_host_over_recompute"] = round(result["host"]["ttft_after_eviction_s"]
                                                         / result["none"]["ttft_after_eviction_s"], 3)
    return result


def distill(work: Path, budget_s: float) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from loopstack.engine.loaders import load_tokenizer

    tokenizer, _ = load_tokenizer(work / "target")
    texts = [p.read_text(errors="replace") for folder in ("core", "plugins", "docs", "scripts")
             for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md") and p.is_file()]
    ids = torch.tensor([t for text in texts for t in tokenizer.encode(text)], dtype=torch.long)
    teacher = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.bfloat16).to(DEVICE[0]).eval()
    student = AutoModelForCausalLM.from_pretrained(work / "draft8", dtype=torch.float32).to(DEVICE[0]).train()
    student.get_input_embeddings().weight.requires_grad_(False)  # tied head: the target's, kept
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    batch, length = size(32, 2), size(512, 128)
    generator = torch.Generator().manual_seed(0)
    steps, losses, started = 0, [], time.perf_counter()
    while time.perf_counter() - started < budget_s:
        starts = torch.randint(0, len(ids) - length, (batch,), generator=generator)
        x = torch.stack([ids[s : s + length] for s in starts]).to(DEVICE[0])
        with torch.no_grad():
            target_logp = F.log_softmax(teacher(x).logits.float(), dim=-1)
        with torch.autocast(DEVICE[0], dtype=torch.bfloat16):
            logits = student(x).logits
        loss = F.kl_div(F.log_softmax(logits.float(), dim=-1), target_logp, log_target=True, reduction="batchmean") / length
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        steps += 1
    out = work / "draft8_distilled"
    student.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((work / "draft8" / name).read_bytes())
    return {"corpus_tokens": len(ids), "steps": steps, "tokens_seen": steps * batch * length,
            "kl_first": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
            "kl_last": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4), "directory": str(out)}


def spec(work: Path, data: Path, drafts: dict[str, Path]) -> dict[str, Any]:
    from loopstack.bench.workload import BenchOptions
    from loopstack.plugins.spec_decode.bench.workload import SpecWorkload

    result: dict[str, Any] = {}
    for label, draft in drafts.items():
        if not (draft / "config.json").is_file():
            continue
        workload = SpecWorkload()
        extra = {"model": str(work / "target"), "draft_model": str(draft), "draft_layers": 0,
                 "per_kind": size(2, 1), "chat": size(6, 1), "max_tokens": size(128, 16), "device": DEVICE[0]}
        options = BenchOptions(data_dir=data, extra=extra)
        columns = ["off", "ngram", "suffix", "draft_model"] if not result else ["off", "draft_model"]

        async def run() -> dict[str, Any]:
            await workload.setup(columns, [], options)
            greedy(workload._engine, [100 + i for i in range(64)], 16)  # warm-up (kernels, allocator)
            return {column: await workload.step(column, 1) for column in columns}

        result[label] = asyncio.run(run())
        result[label]["config"] = {k: v for k, v in workload.config().items() if k != "groups"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"))
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--distill-seconds", type=float, default=75.0)
    parser.add_argument("--only", default="export,reference,speed,profile,kv_tier,distill,spec")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs (e.g. on CPU)")
    args = parser.parse_args()
    DEVICE[0], SMOKE[0] = args.device, args.smoke
    try:
        import loopstack  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _InPlace())
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "export": lambda: export(args, args.work),
        "reference": lambda: reference(args.work),
        "speed": lambda: speed(args.work),
        "profile": lambda: profile(args.work),
        "kv_tier": lambda: kv_tier(args.work),
        "distill": lambda: distill(args.work, args.distill_seconds),
        "spec": lambda: spec(args.work, args.data, {"truncated8": args.work / "draft8",
                                                    "distilled8": args.work / "draft8_distilled"}),
    }
    for name, run in steps.items():
        if name in only:
            section(name, run, args.out)


if __name__ == "__main__":
    main()

"""What quantization costs in accuracy (issue 12): mean per-token KL divergence between the
unquantized and the quantized model's next-token distributions, and greedy agreement, over 16
prompts x 64 tokens, on real weights (the embedded SmolLM2-135M by default).

The unquantized model writes 64 greedy tokens per prompt; then every variant is teacher-forced
through the same tokens (the real core schedules the steps, the engine's own model and KV cache run
them, one token per step after the prompt), so both models are always compared in the same
context. KL(reference || variant) is over the full vocabulary at each of the 16 x 64 positions;
agreement is the share of positions where both put the same token first.

    python benches/bench_quant_accuracy.py [--model PATH] [--variants fp8,fp8-kv,int4-awq] [--device cuda]

Variants: fp8 (online FP8 weights, W8A8 on a GPU), fp8-kv (kv_cache_dtype="fp8"), fp8-kv-calc (the same with
calculate_kv_scales: the scales measured on a first request, one CALIBRATION prompt, before the measured ones), int4-awq (the
weights round-to-nearest quantized into an AWQ-layout folder, group 128), int4-gptq (GPTQ-calibrated
into a GPTQ-layout folder, group 128, act-order, as GPTQModel / AutoGPTQ exports are made; the
calibration set is the reference model's own sampled answers to CALIBRATION, none of the measured
prompts), int4-gptq-static (the same without act-order, in the AWQ layout: what the fused one-token
kernels run), gguf-packed (CPU: the GGUF's blocks kept quantized in packed int4 matmuls, against the
same file dequantized to float32), int8 (compressed-tensors W8A8: int8 weights per channel, int8
activations per token), fp8-block (block-wise FP8, DeepSeek / Qwen3-FP8 layout, activations per group
of 128; blocks of 64 x 128 here, since SmolLM2's 192-row k/v shards cut the usual 128-row blocks).
llama.cpp-TYPE (with --llama-cpp-python, a Python where llama-cpp-python is installed: llama.cpp itself,
for comparison): the GGUF requantized by llama.cpp's own quantizer to TYPE (f32, q8_0, q6_k, q5_k_m, q4_k_m,
q4_0; q4_1 is the file as it is), run by llama.cpp teacher-forced the same way (the prompt, then one token a
call) against the same reference; llama.cpp-f32 shows what the two implementations' arithmetic alone differs by.
Targets: FP8 weights <= 0.02 nats, FP8 KV <= 0.02, int4 <= 0.1. Prints a table, the worst KL last.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench_cpu_quant's llama.cpp child)

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
    "Give me three tips for sleeping better.", "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work.", "Write a Python function that reverses a string.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.", "List five prime numbers.",
    "What does a CPU cache do?", "Describe a cat to someone who has never seen one.",
    "How do vaccines work?", "Write a short story opening about a lighthouse.",
    "What is the difference between weather and climate?", "Explain recursion with an example.",
]
# Calibration prompts for GPTQ: other topics and styles than QUESTIONS.
CALIBRATION = [
    "Tell me about the history of the printing press.", "Write a limerick about a forgetful robot.",
    "How does a bicycle stay upright?", "Explain compound interest to a teenager.",
    "Write a SQL query that finds the ten most recent orders.", "What are the causes of inflation?",
    "Describe the water cycle.", "Give a recipe for a simple tomato soup.",
    "Write a JavaScript function that debounces another function.", "Why do leaves change colour in autumn?",
    "What is a black hole?", "Write a polite email declining a meeting.",
    "Explain the difference between TCP and UDP.", "Summarize the causes of the First World War.",
    "How do I change a flat tyre?", "Write a short poem about mountains at dawn.",
    "What is photosynthesis?", "Explain big-O notation with two examples.",
    "List some tips for learning a new language.", "What does a compiler do?",
    "Describe how a refrigerator works.", "Write a C function that computes a factorial.",
    "What is the Pythagorean theorem?", "Explain what a neural network is in simple words.",
]
TARGETS = {"fp8": 0.02, "fp8-kv": 0.02, "fp8-kv-calc": 0.02, "int4-awq": 0.1, "int4-gptq": 0.1, "int4-gptq-static": 0.1,
           "gguf-packed": None, "int8": None, "fp8-block": 0.02}
SMOLLM2_FP8_BLOCK = (64, 128)


@torch.inference_mode()
def forced_logprobs(llm: Any, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """log-softmax [len(forced[i]), vocab] of every prompt, teacher-forced through `forced`: the
    distribution of token j given the prompt and forced[i][:j]."""
    from ferrox import _core
    from ferrox.worker.dummy_batch import upload_step
    from ferrox.worker.step_inputs import Uploader

    engine = llm.engine
    model, kv = engine.runner.model, engine.runner.kv_caches
    steps = max(len(f) for f in forced)
    max_len = max(len(p) for p in prompts) + steps + 1
    sched = _core.Scheduler(num_blocks=int(kv[0].shape[1]), max_model_len=max_len, block_size=engine.block_size,
                            max_num_seqs=len(prompts), max_num_batched_tokens=sum(len(p) for p in prompts),
                            enable_prefix_caching=False)
    index_of_slot = {}
    for i, p in enumerate(prompts):
        slot = sched.add_request(str(i), np.asarray(p, dtype=np.int64), max_tokens=len(forced[i]),
                                 ignore_eos=True, detokenize=False)
        index_of_slot[slot] = i
    upload = Uploader(torch.device(engine.device))
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    while True:
        so = sched.schedule()
        if so.num_reqs == 0:
            break
        upload.next_step()
        t = upload_step(so, upload)
        hidden = model.forward(t.input_ids, t.positions, kv, t.meta)
        logprobs = torch.log_softmax(model.compute_logits(hidden[t.logits_indices]).float(), dim=-1).cpu()
        tokens = []
        for r, slot in enumerate(np.asarray(so.req_slots).tolist()):
            i = index_of_slot[slot]
            rows[i].append(logprobs[r])
            tokens.append(forced[i][len(rows[i]) - 1])
        sched.update_from_output(np.asarray(tokens, dtype=np.int64))
    return [torch.stack(r) for r in rows]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(ref || got) in nats per position, share of positions with the same top token)."""
    kls, agree, n = 0.0, 0, 0
    for a, b in zip(ref, got, strict=True):
        kls += float((a.exp() * (a - b)).sum(-1).clamp_min(0).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
    return kls / n, agree / n


def make_llm(model: str, device: str, **kw: Any) -> Any:
    from ferrox import LLM

    kv = dict(kv_cache_memory=1 << 30) if device == "cuda" else {}
    return LLM(model=model, device=device, max_model_len=512, max_num_seqs=16, **kv, **kw)


def release(llm: Any) -> None:
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_folder_from_gguf(gguf_path: str, out_dir: str) -> str:
    """The GGUF's weights dequantized into a Hugging Face folder (transformers reads GGUF), so a
    checkpoint-format quantizer can start from them."""
    import transformers

    folder, name = os.path.split(gguf_path)
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model read from a GGUF; its tensors and config are plain, so write them.
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    model.config.quantization_config = None
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(os.path.join(out_dir, "config.json"))
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    return out_dir


def int8_folder(float_folder: str, out_dir: str) -> str:
    """A compressed-tensors W8A8 checkpoint (the tests' reference quantizer, tests/helpers)."""
    from safetensors.torch import load_file

    from tests.helpers.int8_checkpoints import int8_config, int8_tensors
    from tests.helpers.quant_checkpoints import write_checkpoint

    weights = load_file(os.path.join(float_folder, "model.safetensors"))
    return write_checkpoint(float_folder, out_dir, int8_config("channel", "token"), int8_tensors(weights, "channel"))


def fp8_block_folder(float_folder: str, out_dir: str) -> str:
    """A block-wise FP8 checkpoint (the tests' reference quantizer, tests/helpers)."""
    from safetensors.torch import load_file

    from tests.helpers.fp8_block_checkpoints import block_config, block_tensors
    from tests.helpers.quant_checkpoints import write_checkpoint

    weights = load_file(os.path.join(float_folder, "model.safetensors"))
    return write_checkpoint(float_folder, out_dir, block_config(SMOLLM2_FP8_BLOCK),
                            block_tensors(weights, SMOLLM2_FP8_BLOCK))


def awq_folder(float_folder: str, out_dir: str) -> str:
    from tests.helpers.int4_checkpoints import make_int4_checkpoint  # the tests' reference quantizer

    quantized, _ = make_int4_checkpoint(float_folder, out_dir, "awq", group=128)
    return quantized


@torch.inference_mode()
def calibration_hessians(float_folder: str, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each projection's input Hessian sum(x x^T) over the calibration sequences, from the float
    model in transformers (float64 sums), keyed by module name as the checkpoint names it."""
    import transformers

    from tests.helpers.int4_checkpoints import LINEAR_SUFFIXES

    model = transformers.AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32)
    hessians: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def accumulate(_module: Any, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            hessians[name] = hessians.get(name, 0) + x.t() @ x
        return accumulate

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in LINEAR_SUFFIXES]
    for seq in sequences:
        model(torch.tensor([seq]))
    for h in handles:
        h.remove()
    return hessians


def gptq_folder(float_folder: str, out_dir: str, hessians: dict[str, torch.Tensor], *, act_order: bool) -> str:
    from tests.helpers.int4_checkpoints import make_int4_checkpoint

    fmt = "gptq" if act_order else "awq"  # the AWQ layout holds no g_idx: GPTQ in column order
    quantized, _ = make_int4_checkpoint(float_folder, out_dir, fmt, group=128, act_order=act_order,
                                        hessians=hessians)
    return quantized


# llama.cpp's own quantizer (llama_model_quantize), in the llama-cpp-python interpreter: input, output, ftype name.
_LLAMA_CPP_QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + sys.argv[3])
params.allow_requantize = True
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""
_LLAMA_CPP_FTYPES = {"f32": "ALL_F32", "q8_0": "MOSTLY_Q8_0", "q6_k": "MOSTLY_Q6_K", "q5_k_m": "MOSTLY_Q5_K_M",
                     "q4_k_m": "MOSTLY_Q4_K_M", "q4_0": "MOSTLY_Q4_0"}


def llama_cpp_variant(python: str, gguf: str, kind: str, tmp: str, prompts: list[list[int]],
                      forced: list[list[int]]) -> list[torch.Tensor]:
    """llama.cpp's teacher-forced log-probabilities on the GGUF requantized to `kind` by llama.cpp itself."""
    import subprocess

    from bench_cpu_quant import llama_cpp_logprobs

    path = gguf
    if kind != "q4_1":
        if kind not in _LLAMA_CPP_FTYPES:
            raise SystemExit(f"llama.cpp-{kind}: choose one of q4_1, {', '.join(_LLAMA_CPP_FTYPES)}")
        path = os.path.join(tmp, f"model-{kind}.gguf")
        subprocess.run([python, "-c", _LLAMA_CPP_QUANTIZE, gguf, path, _LLAMA_CPP_FTYPES[kind]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return llama_cpp_logprobs(python, path, os.cpu_count() or 1, list(zip(prompts, forced, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llama-cpp-python", default=None,
                    help="a Python with llama-cpp-python, for the llama.cpp-TYPE variants (a GGUF model)")
    args = ap.parse_args()
    from ferrox.loader.source import resolve_model

    source = resolve_model(args.model)
    on_gpu = args.device == "cuda"
    variants = (args.variants or ("fp8,fp8-kv,int4-awq" if on_gpu else "gguf-packed,fp8-kv")).split(",")
    dtype = "bfloat16" if on_gpu else "float32"
    start = time.perf_counter()
    ref_llm = make_llm(source.path, args.device, dtype=dtype)
    tok = ref_llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in QUESTIONS]
    from ferrox import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    forced = [list(o.outputs[0].token_ids) for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     greedy, use_tqdm=False)]
    ref = forced_logprobs(ref_llm, prompts, forced)
    calibration: list[list[int]] = []
    if any(v.startswith("int4-gptq") for v in variants):
        cal_prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
                       for q in CALIBRATION]
        # Two sampled answers a prompt, ~10k tokens in all (48 sequences measured 0.200 nats where 24
        # shorter ones gave 0.212; GPTQ exports use more, but the Hessians are 576-1536 wide here).
        sampled = SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=192, detokenize=False)
        outs = ref_llm.generate([{"prompt_token_ids": p} for p in cal_prompts], sampled, use_tqdm=False)
        calibration = [p + list(c.token_ids) for p, o in zip(cal_prompts, outs, strict=True) for c in o.outputs]
    release(ref_llm)
    print(f"model {source.name} ({source.format}), device {args.device}, reference dtype {dtype}, "
          f"{len(prompts)} prompts x {args.tokens} tokens")
    print(f"{'variant':<12} {'mean KL (nats)':>15} {'greedy agreement':>17} {'target':>8}")
    rows = []
    hessians: dict[str, torch.Tensor] | None = None  # computed once, for every GPTQ variant
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            if name == "fp8":
                llm = make_llm(source.path, args.device, dtype=dtype, quantization="fp8")
            elif name == "fp8-kv":
                llm = make_llm(source.path, args.device, dtype=dtype, kv_cache_dtype="fp8")
            elif name == "fp8-kv-calc":
                llm = make_llm(source.path, args.device, dtype=dtype, kv_cache_dtype="fp8", calculate_kv_scales=True)
                first = tok.encode(tok.apply_chat_template([{"role": "user", "content": CALIBRATION[0]}],
                                                           add_generation_prompt=True))
                llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1), use_tqdm=False)
            elif name.startswith("int4-") or name in ("int8", "fp8-block"):
                float_dir = os.path.join(tmp, "float")
                if source.format != "gguf":
                    float_dir = source.path
                elif not os.path.isdir(float_dir):
                    hf_folder_from_gguf(source.path, float_dir)
                if name == "int8":
                    folder = int8_folder(float_dir, os.path.join(tmp, name))
                elif name == "fp8-block":
                    folder = fp8_block_folder(float_dir, os.path.join(tmp, name))
                elif name == "int4-awq":
                    folder = awq_folder(float_dir, os.path.join(tmp, name))
                elif name in ("int4-gptq", "int4-gptq-static"):
                    if hessians is None:
                        hessians = calibration_hessians(float_dir, calibration)
                    folder = gptq_folder(float_dir, os.path.join(tmp, name), hessians, act_order=name == "int4-gptq")
                else:
                    raise SystemExit(f"unknown variant {name!r}")
                llm = make_llm(folder, args.device, dtype=dtype)
            elif name == "gguf-packed":
                llm = make_llm(source.path, "cpu", dtype="auto")
            elif name.startswith("llama.cpp-"):
                if not args.llama_cpp_python or source.format != "gguf":
                    raise SystemExit(f"{name}: needs --llama-cpp-python and a GGUF model")
                got = llama_cpp_variant(args.llama_cpp_python, source.path, name.split("-", 1)[1], tmp, prompts, forced)
                kl, agree = compare(ref, got)
                rows.append((name, kl, agree, None))
                print(f"{name:<12} {kl:>15.5f} {agree:>17.3f} {'-':>8}")
                continue
            else:
                raise SystemExit(f"unknown variant {name!r}")
            kl, agree = compare(ref, forced_logprobs(llm, prompts, forced))
            release(llm)
            target = TARGETS[name]
            rows.append((name, kl, agree, target))
            print(f"{name:<12} {kl:>15.5f} {agree:>17.3f} {f'<= {target:g}' if target else '-':>8}")
    print(f"({time.perf_counter() - start:.0f} s)")
    worst = max(rows, key=lambda r: r[1])
    print(f"worst mean KL: {worst[0]} {worst[1]:.5f} nats")


if __name__ == "__main__":
    main()

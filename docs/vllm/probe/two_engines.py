"""Can one Python process build a second vLLM engine after the first (a "restart" inside pytest)?
usage: .venv-vllm/bin/python two_engines.py [uni|mp]"""
import gc, os, sys, time
HERE = os.path.dirname(os.path.abspath(__file__)); sys.path.insert(0, HERE)
os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
os.environ["PYTHONPATH"] = HERE
mode = sys.argv[1] if len(sys.argv) > 1 else "uni"
if mode == "uni":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

def engine(tag):
    from vllm import LLM
    kw = dict(model=os.path.join(HERE, "tiny-model"), dtype="float32", enforce_eager=True, block_size=32,
              enable_prefix_caching=False, max_model_len=1024, max_num_seqs=4, disable_hybrid_kv_cache_manager=True,
              kv_transfer_config={"kv_connector": "ProbeConnector", "kv_connector_module_path": "probe_connector",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"log": f"{HERE}/out/two/{tag}.jsonl", "store": f"{HERE}/out/two/store"}})
    if mode == "uni":
        kw["distributed_executor_backend"] = "uni"
    return LLM(**kw)

if __name__ == "__main__":
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    os.makedirs(f"{HERE}/out/two", exist_ok=True)
    p = [3 + (i * 7) % 4000 for i in range(100)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for tag in ("first", "second"):
        t = time.monotonic()
        llm = engine(tag)
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        print(f"RESULT {tag}: start+gen {time.monotonic() - t:.1f}s out={list(o.outputs[0].token_ids)} cached={o.num_cached_tokens}", flush=True)
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm; gc.collect()

"""Compact view of a probe calls.jsonl: one line per call, decode-step noise folded.
usage: python3 summarize_calls.py calls.jsonl"""
import json, sys
t0 = None
skip_layers = 0
for line in open(sys.argv[1]):
    r = json.loads(line)
    t0 = t0 or r["t"]
    m = r["method"]
    if m in ("__init__", "register_kv_caches"):
        extra = {"layers": r.get("layers"), "distinct_ptrs": r.get("distinct_ptrs")} if m == "register_kv_caches" else {"block_size": r.get("block_size")}
    elif m == "save_kv_layer":
        if not r["blocks_saved"] and r["num_actual_tokens"] == 1:
            continue  # decode step
        extra = {k: r[k] for k in ("layer", "blocks_saved", "num_actual_tokens", "seq_lens")}
        extra["slot_mapping[:4]"] = r["slot_mapping"][:4]
    elif m == "wait_for_layer_load":
        if not r["blocks_loaded"]:
            continue
        extra = {"layer": r["layer"], "blocks_loaded": r["blocks_loaded"]}
    elif m == "start_load_kv":
        if not r["loads"] and r["attn_metadata"] != "NoneType":
            continue
        extra = {"loads": r["loads"], "attn_metadata": r["attn_metadata"]}
    elif m == "build_connector_meta":
        if not r["new"] and not r["finished"] and all(v == 1 for v in r["num_scheduled_tokens"].values()):
            continue  # decode step
        extra = {k: r[k] for k in ("new", "cached", "num_scheduled_tokens", "finished", "meta")}
    else:
        extra = {k: v for k, v in r.items() if k not in ("role", "pid", "t", "method")}
    print(f"{(r['t'] - t0) * 1000:8.1f}ms {r['role'][:5]:5} {r['pid']:>6} {m:28} {json.dumps(extra)[:230]}")

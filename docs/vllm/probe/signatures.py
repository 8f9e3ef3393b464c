"""Print KVConnectorBase_V1's public methods with signatures (abstract ones marked): the tripwire's source of truth.
usage: .venv-vllm/bin/python signatures.py [module:Class]   (a connector class to compare against the base)"""
import importlib, inspect, sys
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B
abstract = B.__abstractmethods__
cls = None
if len(sys.argv) > 1:
    m, c = sys.argv[1].split(":"); cls = getattr(importlib.import_module(m), c)
for name, fn in sorted(vars(B).items()):
    if name.startswith("_") and name != "__init__": continue
    f = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    if not callable(f): continue
    sig = str(inspect.signature(f))
    line = f"{'A' if name in abstract else ' '} {name}{sig}"
    if cls is not None and name in vars(cls):
        g = vars(cls)[name]; g = g.__func__ if isinstance(g, (classmethod, staticmethod)) else g
        ps = lambda s: [(p.name, p.kind) for p in inspect.signature(s).parameters.values()]
        line += "   [overridden: " + ("same params" if ps(g) == ps(f) else f"DIFFERENT {inspect.signature(g)}") + "]"
    print(line)

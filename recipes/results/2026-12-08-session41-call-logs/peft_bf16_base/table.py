import json, re
d = json.load(open(__import__("os").path.join(__import__("os").path.dirname(__file__), __import__("os").environ.get("OUT_NAME", "sweep") + ".json")))
from methods import METHODS, EXTRAS, DROPS
rows = []
for m in METHODS + EXTRAS + DROPS:
    r = d.get(m)
    if r is None: continue
    if r.get("error"):
        e = r["error"]
        kind = "refused: shares weights across layers (BlockDetectionError)" if "share the parameter" in e else \
               "refused: gradient hooks on params (OSF)" if "gradient hook" in e else \
               "fails under Lightning's default strategy too" if "ShadowCarrier" in e else e[:80]
        rows.append(f"| {m} | - | - | - | {kind} |")
        continue
    w = r["widened"]
    wn = re.match(r"MegaTrainStrategy: (\d+) weights \(([^)]*)", w[0]) if w else None
    def kind(x):
        p = x.split(".")
        if "base_layer" in p: return p[p.index("base_layer") - 1] + ".base_layer.weight"
        i = max(j for j, q in enumerate(p) if q.endswith("_proj"))
        return ".".join(q for q in p[i + 1:] if q != "default")
    ops = re.search(r"sets another tensor's \(([^)]*)\)", w[0]).group(1) if w else ""
    wtxt = "no" if not w else f"yes: {wn.group(1)} ({', '.join(sorted({kind(x) for x in wn.group(2).split('; ')[0].split(', ') if x and x != '...'}))}...; {ops})"
    same = r["loss_max_abs"] == 0 and r["state_max_rel"] == 0
    st = "0" if r["state_max_rel"] == 0 else f"{r['state_max_rel']:.2e} ({r['state_worst'].split('model.model.')[-1].replace('.default','')})"
    rows.append(f"| {m} | {r['loss_max_abs']:.2e} | {st} | {wtxt} | {'bit-identical' if same else 'DIFFERS'} |")
print("| method | loss max abs diff (6 steps) | state max rel diff (tensor) | widened? | verdict |")
print("|---|---|---|---|---|")
print("\n".join(rows))

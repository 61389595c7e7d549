"""Regenerate argocd-cm.yaml from the Lua files beside it: python charts/rlfleet/argocd/gen_argocd_cm.py"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("RLJob", "SamplerGroup", "WeightChannel")
HEADER = """\
# Merge into Argo CD's argocd-cm ConfigMap (namespace argocd) so Argo CD can tell when rlfleet's
# custom resources are Healthy. The Lua bodies are the files beside this one, verbatim
# (regenerate with gen_argocd_cm.py; tests/ship/test_ship_argocd.py fails when they drift). Apply:
#   kubectl -n argocd patch configmap argocd-cm --type merge --patch-file argocd-cm.yaml
apiVersion: v1
kind: ConfigMap
metadata:
  name: argocd-cm
  namespace: argocd
  labels:
    app.kubernetes.io/name: argocd-cm
    app.kubernetes.io/part-of: argocd
data:
"""


def render() -> str:
    out = HEADER
    for kind in KINDS:
        lua = (HERE / f"{kind.lower()}.lua").read_text()
        out += f"  resource.customizations.health.rlfleet.dev_{kind}: |\n"
        out += "".join(("    " + line) if line.strip() else "\n" for line in lua.splitlines(keepends=True))
    return out


if __name__ == "__main__":
    (HERE / "argocd-cm.yaml").write_text(render())

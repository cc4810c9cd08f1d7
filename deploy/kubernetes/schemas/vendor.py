"""Writes the JSON schemas that tests/test_kubernetes_manifests.py validates our custom resources against,
from the CRDs their projects publish (kubernetes-validate ships only the core API's schemas):

    python deploy/kubernetes/schemas/vendor.py CRD.yaml... # e.g. LWS's
        # config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml, prometheus-operator's
        # example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml

Each served version's openAPIV3Schema, without descriptions and status, into GROUP_KIND_VERSION.json here.
LeaderWorkerSet's pod templates (leaderTemplate, workerTemplate) are cut to "an object": the test validates
them as core/v1 PodTemplateSpecs with kubernetes-validate instead, the same definitions LWS's CRD embeds
(1.3 MB of them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
POD_TEMPLATES = ("leaderTemplate", "workerTemplate")


def trim(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description":
                continue
            if key in POD_TEMPLATES and isinstance(value, dict) and "properties" in value:
                out[key] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                continue
            out[key] = trim(value)
        return out
    if isinstance(node, list):
        return [trim(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    for path in paths:
        crd = yaml.safe_load(Path(path).read_text())
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            schema = version["schema"]["openAPIV3Schema"]
            schema["properties"].pop("status", None)
            name = f"{spec['group']}_{spec['names']['kind']}_{version['name']}.json".lower()
            (HERE / name).write_text(json.dumps(trim(schema), indent=1, sort_keys=True) + "\n")
            print(name)


if __name__ == "__main__":
    main(sys.argv[1:])

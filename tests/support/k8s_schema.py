"""The Kubeflow Trainer ``TrainJob`` schema, from a Trainer release, as a validator.

The schema comes from ``kubeflow-trainer-api`` (a dev dependency): the Trainer project's
published models of its v1alpha1 API, generated from the same Go types as the TrainJob
CRD's ``openAPIV3Schema`` (the CRD file itself is 550 KB of YAML). It is checked as an API
server with ``fieldValidation=Strict`` would: JSON Schema (draft 2020-12) of the TrainJob
model, with unknown fields refused at every level. One fix-up: the generator renders
``resource.Quantity`` as an empty object; the CRD's own schema for it (an integer or a
string such as ``8`` or ``16Gi``) replaces it.
"""

from __future__ import annotations

import functools
from typing import Any

import jsonschema

__all__ = ["TrainJobInvalid", "trainjob_schema", "validate_trainjob"]


class TrainJobInvalid(ValueError):
    pass


def _close(node: Any) -> None:
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            _close(v)
    elif isinstance(node, list):
        for v in node:
            _close(v)


@functools.cache
def trainjob_schema() -> dict[str, Any]:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    schema = TrainerV1alpha1TrainJob.model_json_schema(by_alias=True)
    _close(schema)
    schema["$defs"]["IoK8sApimachineryPkgApiResourceQuantity"] = QUANTITY
    return schema


#: ``resource.Quantity`` as the TrainJob CRD writes it.
QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(trainjob_schema())


def validate_trainjob(body: dict[str, Any]) -> None:
    """Raise :class:`TrainJobInvalid` naming every problem of a TrainJob body."""
    problems = [
        f"{'.'.join(map(str, leaf.absolute_path)) or '<root>'}: {leaf.message}"
        for error in _validator().iter_errors(body)
        for leaf in _leaves(error)
    ]
    if body.get("apiVersion") != "trainer.kubeflow.org/v1alpha1" or body.get("kind") != "TrainJob":
        problems.append("apiVersion/kind must be trainer.kubeflow.org/v1alpha1 TrainJob")
    spec = body.get("spec") or {}
    if not isinstance(spec, dict) or not spec.get("runtimeRef"):
        problems.append("spec.runtimeRef is required")
    if problems:
        raise TrainJobInvalid("; ".join(problems[:10]))


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The innermost errors (an ``anyOf`` of a model or null reports its real cause)."""
    if not error.context:
        return [error]
    inner = [leaf for c in error.context for leaf in _leaves(c)]
    return [e for e in inner if e.validator != "type" or e.validator_value != "null"] or inner

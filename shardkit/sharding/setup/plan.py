"""Decide the units: which module each one wraps and which parameters (by every name) it owns."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..wrap_policies import WrapPolicy


@dataclass
class ParamPlan:
    """One distinct parameter object: all its names, the modules holding it, its unit."""

    param: nn.Parameter
    fqns: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    unit_names: list[str] = field(default_factory=list)  # unit of each occurrence
    unit: str = ""


@dataclass
class UnitPlan:
    """A unit-to-be: the module it wraps (by path) and its parameters in state_dict order."""

    name: str
    module: nn.Module
    params: list[ParamPlan] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str]] = field(default_factory=list)  # cast under buffer_dtype


def _choose_unit_modules(root: nn.Module, policy: WrapPolicy | None) -> dict[str, nn.Module]:
    chosen: dict[str, nn.Module] = {}
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, parent: nn.Module | None) -> int:
        unclaimed = sum(p.numel() for p in module._parameters.values() if p is not None)
        for child_name, child in module._modules.items():
            if child is not None:
                unclaimed += visit(f"{name}.{child_name}" if name else child_name, child, module)
        if (module is not root and policy is not None and unclaimed > 0
                and id(module) not in seen
                and policy.should_wrap(module, parent=parent, unclaimed_numel=unclaimed)):
            chosen[name] = module
            seen.add(id(module))
            return 0
        return unclaimed

    visit("", root, None)
    chosen[""] = root
    return chosen


def _unit_of(path: str, unit_names: set[str]) -> str:
    # The nearest enclosing unit of a module path ("" is the root unit).
    while path and path not in unit_names:
        path = path.rpartition(".")[0]
    return path


def _common_unit(names: list[str], unit_names: set[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    prefix: list[str] = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        prefix.append(column[0])
    return _unit_of(".".join(prefix), unit_names)


def plan_units(root: nn.Module, policy: WrapPolicy | None) -> list[UnitPlan]:
    """Return units bottom-up (root last) with every parameter assigned to exactly one unit.

    A parameter reached from several units (tied weights) belongs to their nearest common
    enclosing unit, which stays gathered while all its users run, so both uses see one tensor
    and its gradient is reduced once.
    """
    chosen = _choose_unit_modules(root, policy)
    unit_names = set(chosen)
    by_id: dict[int, ParamPlan] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            plan = by_id.setdefault(id(param), ParamPlan(param))
            plan.fqns.append(f"{mod_name}.{attr}" if mod_name else attr)
            if (module, attr) not in [(m, a) for m, a in plan.owners]:
                plan.owners.append((module, attr))
            plan.unit_names.append(_unit_of(mod_name, unit_names))
    units = {name: UnitPlan(name, module) for name, module in chosen.items()}
    for mod_name, module in root.named_modules():
        for attr, buf in module._buffers.items():
            if buf is not None:
                units[_unit_of(mod_name, unit_names)].buffers.append((module, attr))
    for plan in by_id.values():
        plan.unit = _common_unit(plan.unit_names, unit_names)
        units[plan.unit].params.append(plan)
    # Deepest paths first so nested units come before their parents; the root ("") ends up last.
    order = sorted(units, key=lambda n: (-(n.count(".") + 1) if n else 1, list(chosen).index(n)))
    return [units[n] for n in order if units[n].params or n == ""]


def all_param_plans(units: list[UnitPlan]) -> list[ParamPlan]:
    """Every ParamPlan across units."""
    return [p for u in units for p in u.params]

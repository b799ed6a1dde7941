"""GaLore and APOLLO (`galore-torch`, `apollo-torch`): AdamW whose moments live in a low-rank
projection of the gradients of chosen linear layers; every other parameter trains with plain
AdamW in the same optimizer (transformers' grouping for `--optim galore_adamw|apollo_adamw`).

Both keep each projection in a Python object (`state["projector"]`), which torch's
`state_dict()` would hand over as is: not a tensor, not JSON, so no checkpoint could hold it.
`checkpointable` gives the optimizer a `state_dict()` that stores the projection's matrix (and
APOLLO's random-stream seed) as ordinary entries, and a `load_state_dict()` that rebuilds the
projector from them and from its group's settings: a resumed run projects with the same
matrix, and refreshes it at the same steps, as the run that saved it.
"""

import re

import torch

from swiftlm.errors import ConfigError

EXTRA = "pip install 'swiftlm[optimizers]'"
DEFAULT_TARGETS = (r".*attn.*", r".*mlp.*")
MATRIX_KEY, SEED_KEY = "projector_matrix", "projector_seed"


def target_weights(model: torch.nn.Module, patterns: list[str] | None) -> list[str]:
    """Names of the trainable weights of the nn.Linear layers whose module names match one
    of `patterns` (regexes, full match; default: attention and MLP layers)."""
    regexes = [re.compile(p) for p in (patterns or DEFAULT_TARGETS)]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    names = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if any(r.fullmatch(module_name) for r in regexes) and f"{module_name}.weight" in trainable:
            names.append(f"{module_name}.weight")
    return names


def projected_groups(model, names: list[str], settings: dict, weight_decay: float, flag: str):
    from swiftlm.train.optim import decay_groups

    """The plain parameters' groups (decay on matrices only), then the projected weights'
    group with the projection's settings (transformers' grouping for GaLore/APOLLO)."""
    if not names:
        raise ConfigError(
            f"--optim {flag}: no trainable nn.Linear layer matches --optim_target_modules "
            "(default: '.*attn.*' '.*mlp.*'); give regexes of the model's module names, and "
            "train them (--train_type full)"
        )
    wanted = set(names)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = [p for n, p in params if n not in wanted]
    projected = [p for n, p in params if n in wanted]
    return [
        *decay_groups(plain, weight_decay),
        {"params": projected, "weight_decay": weight_decay, **settings},
    ]


def galore_class():
    try:
        from galore_torch import GaLoreAdamW
    except ImportError:
        raise ConfigError(f"--optim galore_adamw needs galore-torch: {EXTRA}") from None
    return checkpointable(GaLoreAdamW, _galore_projector)


def apollo_class():
    try:
        from apollo_torch import APOLLOAdamW
    except ImportError:
        raise ConfigError(f"--optim apollo_adamw needs apollo-torch: {EXTRA}") from None
    return checkpointable(APOLLOAdamW, _apollo_projector)


def _galore_projector(optimizer, group, state):
    from galore_torch.galore_projector import GaLoreProjector

    keys = ("update_proj_gap", "scale", "proj_type")
    return GaLoreProjector(group["rank"], **{k: group[k] for k in keys})


def _apollo_projector(optimizer, group, state):
    return optimizer._initialize_projector(group, state)


def checkpointable(optimizer_class, make_projector):
    """A subclass of `optimizer_class` whose state dict holds each projector as tensors and
    numbers. `make_projector(optimizer, group, state)` builds an empty one from its group."""

    class Checkpointable(optimizer_class):
        def state_dict(self):
            saved = super().state_dict()  # its entries are the live state dicts: copied
            saved["state"] = {
                index: _with_projector_entries(entry) for index, entry in saved["state"].items()
            }
            return saved

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for param in group["params"]:
                    state = self.state.get(param)
                    if state and MATRIX_KEY in state:
                        state["projector"] = _rebuilt(make_projector(self, group, state), state)

    Checkpointable.__name__ = Checkpointable.__qualname__ = (
        f"Checkpointable{optimizer_class.__name__}"
    )
    return Checkpointable


def _with_projector_entries(entry: dict) -> dict:
    entry = dict(entry)
    projector = entry.pop("projector", None)
    if projector is None:
        return entry
    if projector.ortho_matrix is not None:  # proj_type full (two matrices) is refused earlier
        entry[MATRIX_KEY] = projector.ortho_matrix
    if hasattr(projector, "seed"):  # APOLLO's random projections: the stream's next seed
        entry[SEED_KEY] = projector.seed
    return entry


def _rebuilt(projector, state: dict):
    projector.ortho_matrix = state.pop(MATRIX_KEY)
    if SEED_KEY in state:
        projector.seed = state.pop(SEED_KEY)
    return projector

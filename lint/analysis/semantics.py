"""Library facts the analysis relies on: what torch, transformers, TRL/verl/OpenRLHF helpers and Ray calls do.

These play the role of Pysa's *models* for code the linter cannot read: which calls keep a tensor's identity and
layout, which stop autograd, which compute log-probs or an entropy, which build a new model, which zero gradients,
which run on another process. They are facts about libraries, keyed by qualified name or method name; they never
decide what a *user's* variable is. Exact names of library helpers (``selective_log_softmax``,
``logprobs_from_logits``) are facts about those libraries, not guesses about user code.
"""

from __future__ import annotations

import re

import libcst as cst

# ----- methods that return "the same tensor" (dtype, device, layout, a copy of the values) ----------------------
SAME_VALUE_METHODS = frozenset({
    "float", "double", "half", "bfloat16", "bool", "long", "int", "to", "type", "type_as", "contiguous", "clone",
    "cpu", "cuda", "view", "reshape", "view_as", "reshape_as", "squeeze", "unsqueeze", "expand", "expand_as",
    "flatten", "as_subclass", "requires_grad_", "permute", "transpose", "t", "repeat", "repeat_interleave",
    "narrow", "masked_fill", "masked_fill_", "nan_to_num", "clamp", "clip", "clamp_", "clip_", "clamp_min",
    "clamp_max", "pin_memory", "share_memory_", "abs", "neg", "exp", "log", "sqrt", "pow", "square", "sigmoid",
    "tanh", "sum", "mean", "nansum", "nanmean", "cumsum", "max", "min", "amax", "amin", "std", "var", "norm",
    "mul", "mul_", "div", "div_", "add", "add_", "sub", "sub_", "softmax", "log_softmax", "gather", "index_select",
    "masked_select", "chunk", "split", "unbind", "flip", "roll", "sort", "topk", "logsumexp", "prod",
})
# Functions of torch whose result derives from their tensor arguments.
TENSOR_FUNCTIONS_PREFIXES = ("torch.", "torch.nn.functional.", "F.")
# Results that never carry autograd, whatever their inputs.
DETACHING_METHODS = frozenset({
    "detach", "detach_", "item", "tolist", "numpy", "argmax", "argmin", "argsort", "nonzero", "size", "numel",
    "dim", "ne", "eq", "gt", "lt", "ge", "le", "isnan", "isinf", "isfinite", "logical_not", "logical_and",
    "logical_or", "bool", "long", "int", "data_ptr", "multinomial", "bernoulli", "sample", "shape",
})
DETACHING_FUNCTIONS = frozenset({
    "torch.zeros", "torch.ones", "torch.full", "torch.empty", "torch.arange", "torch.randn", "torch.rand",
    "torch.randint", "torch.randperm", "torch.zeros_like", "torch.ones_like", "torch.full_like", "torch.empty_like",
    "torch.rand_like", "torch.randn_like", "torch.tensor", "torch.as_tensor", "torch.eye", "torch.linspace",
    "torch.multinomial", "torch.argmax", "torch.argmin", "torch.argsort", "torch.isfinite", "torch.isnan",
    "torch.eq", "torch.ne", "torch.where_index", "len", "int", "float", "bool", "str", "range", "isinstance",
    "hasattr", "getattr", "id", "type", "print", "repr", "math.sqrt", "math.log", "math.exp", "numpy.array",
    "numpy.asarray", "torch.no_grad", "torch.inference_mode", "torch.bucketize", "torch.searchsorted",
})
DATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "data", "grad"})

# ----- autograd contexts -----------------------------------------------------------------------------------------
GRAD_OFF_CONTEXTS = frozenset({
    "torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode", "torch.autograd.inference_mode",
})
GRAD_ON_CONTEXTS = frozenset({"torch.enable_grad", "torch.autograd.enable_grad"})
NULL_CONTEXTS = frozenset({"contextlib.nullcontext", "nullcontext", "contextlib.suppress"})
GRAD_SWITCH = "torch.set_grad_enabled"
# Keyword arguments that, with a literal value, tell a helper the linter cannot read to run without autograd.
NO_GRAD_KEYWORDS = {"use_grad": False, "with_grad": False, "requires_grad": False, "enable_grad": False,
                    "grad": False, "no_grad": True, "detach": True, "inference": True, "inference_mode": True}

# ----- log-probs, logits, entropy ------------------------------------------------------------------------------
LOG_SOFTMAX = frozenset({"torch.log_softmax", "torch.nn.functional.log_softmax", "torch.special.log_softmax"})
SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax"})
GATHER = frozenset({"torch.gather", "torch.take_along_dim"})
CROSS_ENTROPY = frozenset({"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"})
LOSS_CLASSES = frozenset({"torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss"})
# Library helpers that return per-token log-probs of labels under logits (TRL, verl, OpenRLHF, trlx, NeMo-RL...).
LOGPROB_HELPER = re.compile(
    r"(?i)selective_log_softmax|\w*log_?probs?_(from|of)_\w+|gather_\w*log_?probs?\w*|\w*logps?_from_logits"
    r"|logprobs_from_logits\w*|\w*log_?prob_from_logits|get_per_token_logps|_get_per_token_logps\w*"
    r"|log_softmax_and_gather\w*")
# Library helpers that return the entropy of logits.
ENTROPY_HELPER = re.compile(r"(?i)entropy_from_logits\w*|\w*_entropy_from_logits|compute_entropy\w*|"
                            r"entropy_from_log_?probs|calc_entropy|token_entropy|categorical_entropy")
CATEGORICAL = frozenset({"torch.distributions.Categorical", "torch.distributions.categorical.Categorical",
                         "torch.distributions.OneHotCategorical", "Categorical", "torch.distributions.Normal",
                         "Normal", "torch.distributions.normal.Normal"})
ENTROPY_FUNCTIONS = frozenset({"torch.special.entr"})
# Contexts under which a PEFT policy runs with its adapter off (its forwards are the reference's).
ADAPTER_OFF = re.compile(r"(?i)disable_adapters?|null_ref_context|adapter_disabled|without_adapter")

# Tensors filled with a constant: their values come from no model.
FILLED_FUNCTIONS = frozenset({"torch.zeros", "torch.zeros_like", "torch.ones", "torch.ones_like", "torch.full",
                              "torch.full_like", "numpy.zeros", "numpy.zeros_like", "numpy.ones", "numpy.ones_like",
                              "numpy.full", "numpy.full_like"})
FILLED_METHODS = frozenset({"new_zeros", "new_ones", "new_full"})
# ... and buffers made to be written into (`out = torch.full(shape, pad); out[i, :n] = t`), uninitialised ones too
BUFFER_FUNCTIONS = FILLED_FUNCTIONS | {"torch.empty", "torch.empty_like", "numpy.empty", "numpy.empty_like"}
BUFFER_METHODS = FILLED_METHODS | {"new_empty"}

# ----- models ---------------------------------------------------------------------------------------------------
# Methods of a model that hand back the same module object (nn.Module.to/eval/half... work in place).
SAME_MODULE_METHODS = frozenset({"eval", "train", "to", "cuda", "cpu", "half", "float", "double", "bfloat16",
                                 "requires_grad_", "to_empty", "type", "share_memory"})
SAME_MODULE_FUNCTIONS = frozenset({"torch.compile"})
# ... and calls that hand back the model they wrap for the runtime (HF Trainer's `self._wrap_model(m)`, accelerate's
# `prepare_model(m)`): the same module, wrapped, not another model
SAME_MODULE_CALL = re.compile(r"(?i)unwrap_model|unwrap\w*|get_unwrapped\w*|_?wrap_model|prepare_model")
# Methods of a model that are no forward pass.
NON_FORWARD_METHODS = frozenset({
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "named_children", "eval", "train", "to", "cuda", "cpu", "half", "float", "bfloat16", "state_dict",
    "load_state_dict", "zero_grad", "requires_grad_", "save_pretrained", "get_input_embeddings", "apply",
    "register_forward_hook", "register_buffer", "gradient_checkpointing_enable", "gradient_checkpointing_disable",
    "tie_weights", "resize_token_embeddings", "num_parameters", "get_output_embeddings", "disable_adapter",
    "enable_adapters", "disable_adapters", "set_adapter", "merge_adapter", "unmerge_adapter", "print_trainable_parameters",
    "get_base_model", "generate", "config", "push_to_hub", "add_module", "register_module", "get_submodule",
})
# Calls that build a new model object (never an alias of an existing one).
NEW_MODEL_CALLS = re.compile(r"(?i)(\w+\.)*(from_pretrained|from_config|deepcopy|create_reference_model|"
                             r"load_model\w*|build_model\w*|make_model\w*|create_model\w*|init_model\w*|"
                             r"get_model|instantiate\w*|clone_model)")
# A factory's name is a verb and what it makes (``init_model``, ``create_reference_model``): the object it returns
# is named for the product, not for the verb (``init_model`` builds a model; ``init_model`` bound as a variable
# names the initial, reference, model).
_FACTORY_VERB = re.compile(r"(?i)^(init|initialize|initialise|load|build|make|create|get|setup|prepare|instantiate|"
                           r"clone|new)_(?=\w)")


def product_name(callee: str) -> str:
    """The name of what a factory call makes: ``init_model`` -> ``model``, ``create_reference_model`` ->
    ``reference_model``; other callee names as they are."""
    return _FACTORY_VERB.sub("", callee, count=1) if callee else callee


SHALLOW_COPY = frozenset({"copy.copy"})
DEEP_COPY = frozenset({"copy.deepcopy"})
# Methods of a model, named for inference, whose code is out of view: whether they run autograd is unknown.
INFERENCE_METHOD = re.compile(r"(?i)(infer|inference|predict|evaluate|eval_|score|compute_scores?)\w*")
# Calls that take a model and produce rollouts (token ids, texts): no gradient reaches their results.
ROLLOUT_CALL = re.compile(r"(?i)\w*(generate|rollout|sample|collect|play|decode)\w*")

# ----- optimisation -----------------------------------------------------------------------------------------------
ZERO_GRAD_METHODS = frozenset({"zero_grad", "zero_grads", "clear_grad", "clear_grads", "clear_gradients"})
GRAD_RESET_METHODS = frozenset({"zero_", "detach_", "fill_", "requires_grad_"})
OPTIMIZER_CLASS = re.compile(r"(?i)(\w*adam\w*|sgd|rmsprop|adagrad|adadelta|adamax|lion|adafactor|lamb|lars|"
                             r"\w*optimizer|\w*optimiser|muon|shampoo|sophia\w*)")
BACKWARD_METHODS = frozenset({"backward", "manual_backward"})
# Receivers whose `.backward(loss)` / `.step()` are a framework's own (DeepSpeed engines zero their gradients).
ENGINE_NAME = re.compile(r"(?i)(\w*_)?(engine|accelerator|strategy|fabric|deepspeed\w*|ds_\w+|model_engine)")

# ----- other processes --------------------------------------------------------------------------------------------
def is_remote_call(call: cst.Call, qualified: str | None) -> bool:
    """A call whose result comes from another process (Ray actor/worker-group RPC): plain data, no autograd."""
    func = call.func
    if qualified in ("ray.get", "ray.wait"):
        return True
    if isinstance(func, cst.Attribute):
        if func.attr.value in ("remote", "async_remote"):
            return True
        inner = func.value
        if isinstance(inner, cst.Attribute) and inner.attr.value in ("remote",):
            return True
        owner = _last_name(inner)
        if owner is not None and re.fullmatch(r"(?i)\w*_wg|\w*worker_group\w*|\w*_actors?|\w*_workers?|"
                                              r"\w*_actor_group|\w*rpc\w*", owner):
            return True
    return False


def _last_name(expr: cst.BaseExpression) -> str | None:
    kind = type(expr)
    if kind is cst.Name:
        return expr.value
    if kind is cst.Attribute:
        return expr.attr.value
    return None


def method_name(call: cst.Call) -> str | None:
    """``x.backward()`` -> "backward"; None for calls of bare names."""
    return call.func.attr.value if type(call.func) is cst.Attribute else None


def called_name(call: cst.Call) -> str | None:
    """The last name of what is called: ``a.b.f()`` -> "f", ``f()`` -> "f"."""
    return _last_name(call.func)


def receiver(call: cst.Call) -> cst.BaseExpression | None:
    """``opt.step()`` -> ``opt``."""
    return call.func.value if type(call.func) is cst.Attribute else None


def argument(call: cst.Call, position: int | None, keyword: str | None = None) -> cst.BaseExpression | None:
    """The value of a call's argument by keyword, else by position (None when absent)."""
    for arg in call.args:
        if keyword is not None and arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    if position is None:
        return None
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[position].value if position < len(positional) else None


# Cross-process collectives that hand back the values they are given (gathered from every rank): sign-keeping.
COLLECTIVE_FUNCTIONS = frozenset({"accelerate.utils.gather", "accelerate.utils.operations.gather",
                                  "accelerate.utils.gather_for_metrics", "accelerate.utils.reduce",
                                  "accelerate.utils.operations.reduce"})
COLLECTIVE_METHODS = frozenset({"gather", "gather_for_metrics", "reduce"})


def collected(a, call: cst.Call) -> cst.BaseExpression | None:
    """The tensor a cross-process gather or reduce hands back the values of: ``gather(x)`` (accelerate),
    ``accelerator.gather(x)``, ``accelerator.reduce(x)``; None for anything else (``x.gather(-1, idx)`` is an index
    gather, with two arguments)."""
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    if len(positional) != 1 or any(arg.keyword is not None and arg.keyword.value in ("dim", "index") for arg in
                                   call.args):
        return None
    if a.call_name(call) in COLLECTIVE_FUNCTIONS:
        return positional[0].value
    if method_name(call) in COLLECTIVE_METHODS and receiver(call) is not None and "accelerat" in (
            a.code(receiver(call)).lower()):
        return positional[0].value  # the Accelerator's collectives (`self.accelerator.gather(x)`)
    return None


def literal_bool(expr: cst.BaseExpression | None) -> bool | None:
    if isinstance(expr, cst.Name) and expr.value in ("True", "False"):
        return expr.value == "True"
    return None


def int_value(expr: cst.BaseExpression | None) -> int | None:
    """``1`` -> 1, ``-1`` -> -1; None for anything else."""
    if isinstance(expr, cst.Integer):
        return _literal(expr, int)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus) and isinstance(
            expr.expression, cst.Integer):
        return -_literal(expr.expression, int)
    return None


def _literal(expr: cst.Integer | cst.Float, kind: type):
    """A number literal's value: ``kind(text)`` for the plain spellings (a hot path: libcst's ``evaluated_value``
    parses the literal with ``ast.literal_eval`` at every call), libcst's reading for the others (``0x9E3779B1``,
    ``0o17``)."""
    try:
        return kind(expr.value)
    except ValueError:
        return kind(expr.evaluated_value)


def string_value(expr: cst.CSTNode | None) -> str | None:
    """The value of a string literal (``"--beta"``, implicit concatenation included), else None."""
    if isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        try:
            value = expr.evaluated_value
        except Exception:  # noqa: BLE001 - an odd literal (bytes, an f-string part): not a plain string
            return None
        return value if isinstance(value, str) else None
    return None


def number_value(expr: cst.BaseExpression | None) -> float | None:
    kind = type(expr)
    if kind is cst.Integer or kind is cst.Float:
        return _literal(expr, float)
    if kind is cst.UnaryOperation and type(expr.operator) is cst.Minus:
        inner = number_value(expr.expression)
        return None if inner is None else -inner
    return None

"""RLG007 sampler-trainer-mismatch: old log-probs from a sampler at another temperature than the trainer's."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from rlguard.catalog import SAMPLER_TRAINER_MISMATCH
from rlguard.lint.analysis import Analysis, dotted_name
from rlguard.lint.analysis.alignment import gather_site, gather_sites
from rlguard.lint.analysis.grad import grad_context
from rlguard.lint.analysis.records import splat_entry
from rlguard.lint.analysis.semantics import CROSS_ENTROPY, argument, literal_bool
from rlguard.lint.analysis.temperature import (TEMPERATURE_WORD, all_assignments, applies_temperature, autocast_region,
                                               gathered_logp, is_model_call, logits_divisor,
                                               is_sampling_call, key_name, loss_inputs, model_call_of, model_role,
                                               may_reach, plain_reaching, temperature_expr, upcast)
from rlguard.lint.rule import Invalid, Rule, Valid, Violation


TEMPERATURE_KEYWORDS = ("temperature", "temp", "sampling_temperature", "tau")
SAMPLER_CALL = re.compile(r"(?i)\w*(generate|sample|rollout|collect|decode)\w*|SamplingParams|GenerationConfig|"
                          r"RequestConfig|\w*SamplingConfig")
EVAL_NAME = re.compile(r"(?i)\w*(eval|valid|test|greedy|bench|demo|inference|predict)\w*")
ROLLOUT_FUNCTION = re.compile(r"(?i)\w*(rollout|collect|experience|make_batch|sample_batch|generate_batch)\w*")
CONFIG_OBJECT = re.compile(r"(?i)(self\.)?(cfg|config|conf|args|hparams|params|opts|settings)")
LOGP_CALL = re.compile(r"(?i)\w*(log_?probs?|logps?)\w*")
RECOMPUTE = re.compile(r"(?i)\b(model|policy|actor|lm|net)\s*\(|log_softmax|\.gather\(|\.log_prob\(|"
                       r"log_?probs?_(from|of)_\w+\(|selective_log_softmax|(get|compute)_\w*log_?probs?\(")
SAMPLING_OPS = ("torch.multinomial", "multinomial")


# old log-probs from the sampler's scores, the reference's logits divided ({trainer}: the trainer's logits)
_SAMPLER_SCORES = (
    "import torch\n"
    "from transformers import GenerationConfig\n"
    "\n"
    "\n"
    "def train(policy, ref_model, opt, prompts, adv, args):\n"
    "    gen_kwargs = {{\"max_new_tokens\": 64, \"temperature\": args.temperature, \"do_sample\": True}}\n"
    "    config = GenerationConfig(**gen_kwargs)\n"
    "    with torch.no_grad():\n"
    "        out = policy.generate(prompts, generation_config=config, output_scores=True, return_dict_in_generate=True)\n"
    "        seq = out.sequences[:, prompts.size(1):]\n"
    "        a = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
    "        y = ref_model(out.sequences).logits[:, prompts.size(1) - 1:-1] / args.temperature\n"
    "        c = torch.log_softmax(y, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
    "    for _ in range(args.epochs):\n"
    "{trainer}        b = torch.log_softmax(z, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
    "        ratio = torch.exp(b - a)\n"
    "        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + args.beta * (b - c).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
)


_FUSED_LOSS_ELSEWHERE = (
    'class Learner:\n'
    '    def __init__(self, policy, cfg):\n'
    '        self.policy, self.temperature = {policy}, cfg.temperature\n'
    '        self.fused = FusedLinearLoss(beta=cfg.beta, temperature=self.temperature)\n'
    '        self.sampling = SamplingParams(temperature=self.temperature, logprobs=0)\n'
    '\n'
    '    def token_logps(self, model, ids, n):\n'
    '        out = model(input_ids=ids)\n'
    '        logits = out.logits[:, :-1, :][:, -n:, :]\n'
    '        return selective_log_softmax(logits, ids[:, -n:])\n'
    '\n'
    '    def loss(self, model, batch):\n'
    '        logp = self.token_logps({scored}, batch["ids"], batch["n"])\n'
    '        return -(torch.exp(logp - batch["sampling_logp"]) * batch["adv"]).mean()\n')

class SamplerTrainerMismatch(Rule):
    """
    ## What it flags
    Old (behaviour) log-probs that come from a sampler whose distribution differs from the one the trainer
    scores, where both temperatures are visible in the module:

    - the sampler runs at one temperature (`generate(..., temperature=0.7)`, `Categorical(logits=z / 0.7).sample()`,
      `sample(..., temperature=SAMPLER_TEMP)`, `SamplingParams(temperature=...)`, or `logits / 0.7` inside a
      sampling function) and the trainer's log-probs divide the logits by another (`logits / TRAIN_TEMP`),
      with literal values or names bound to different literals (module constants, `self.` attributes,
      config-class defaults);
    - the trainer's log-probs come from logits *not* divided by the temperature while the sampler's
      temperature is visibly not 1;
    - a training rollout that hard-codes its sampling temperature (a literal or module constant other than
      1) while it takes every other setting from a config object that this module never asks for its
      temperature: the trainer, which reads the config, scores another distribution.

    The first two cases need evidence that the sampler's log-probs are used as old log-probs (an old-logp name
    such as `old_logp`, `sampler_logp`, `rollout_log_probs` is read and not recomputed from the model in this
    module). Sampling for evaluation (`evaluate`, `greedy`, `do_sample=False`) is ignored.

    When the temperatures are configured rather than literal:

    - the sampler's temperature is a symbol (`SamplingParams(temperature=cfg["rollout"]["temperature"])`,
      `GenerationConfig(temperature=args.temperature)`, a caller's parameter) and the trainer scores the
      policy's logits undivided, where no temperature the module applies can reach those logits (a division by
      a temperature, a `temperature=` handed to a model wrapper or log-prob helper, a logits warper: none in the
      scoring function or the helpers it calls, none handed to it by its callers, none building the model it
      runs; when the logits come from elsewhere than a forward in the scoring function, none anywhere in the
      module), and the module uses the sampler's log-probs or scores (an old-logp value, `output_scores=True`,
      `logprobs=`). A temperature handed to a fused loss built for another path does not reach them;
    - one method divides a model's logits by a temperature symbol (`logits.div_(cfg["generation"]["temperature"])`)
      while another method of the same class scores the same model's logits undivided and applies no
      temperature at all (the old log-probs recomputed at temperature 1, or the training loss at temperature 1);
      logits handed to an opaque loss callable (`loss, m = loss_fn(logits, mb)`, then `.backward()`) count as
      scored;
    - a caller passes a temperature positionally into a log-prob helper's parameter that is not one (the
      helper's `cu_seqlens` slot), and the helper never divides its logits;
    - a function takes the sampling temperature as a parameter (`def logps(model, ids, temperature)`) and
      computes log-probs, but never divides by it nor hands it on: every read is a guard (`if temperature !=
      1.0:`), an assertion, an error message or a log line; or one branch divides its model's logits by the
      parameter and the other branch scores its logits undivided;
    - a method computes log-probs at an optional temperature parameter that falls back to 1
      (`temperature or 1.0`, default `None`) that no call in the module passes, while its class holds the
      configured temperature (`self.temperature`) and trains with it;
    - the old log-probs of a ratio are the sampler's own, the log-softmax of the scores a generation returned
      (`generate(..., output_scores=True)`: HF's scores are shaped by the sampler's temperature), the sampler is
      handed a temperature not visibly 1, and the log-probs they are compared with come from the policy's
      logits undivided, even where the module divides other logits (the reference's) by the temperature.

    A sampler's temperature is read from its keyword or from the entry of a dict literal handed in as
    `**kwargs` (`GenerationConfig(**gen_kwargs)`).

    Library and runtime semantics visible in the module:

    - an inference engine configured without asking for processed log-probs (megatron-core `InferenceConfig`,
      vLLM `LLM` / `EngineArgs` / `AsyncEngineArgs` without `logprobs_mode="processed_logprobs"`: their
      log-probs are taken before temperature and top-p), while the module samples at a temperature that is not
      provably 1 and asks for the engine's log-probs;
    - the trainer's forward runs under `torch.autocast`, but its log-softmax is taken after the block on the
      half-precision logits (no `.float()`), while the old log-probs it is compared with in `exp(new - old)`
      come from the sampler;
    - logits divided by the temperature only under `isinstance(fn, (LogprobsHead, ...))`, for consumers that
      compute log-probs, while a consumer of another type in a sibling branch hands the same logits to a loss
      callable unscaled;
    - a temperature applied to log-probs already gathered from a log-softmax (`token_logp / T`,
      `token_logp /= T`): the result is no temperature's log-probs.

    What the source cannot show is left to the runtime checks: an engine's log-prob mode set by an
    environment variable or a version default (vLLM V0 returned processed log-probs, V1 raw ones), a
    temperature applied inside another file's model wrapper, or a precision that differs only at run time.
    The `SamplerConsistent` contract (trainer log-probs equal the sampler's on the sampled tokens at the first
    minibatch of an update) and the preflight checks `sampler_logp` and `ratio_one` catch those.

    ## Why it is wrong
    PPO's ratio `exp(logp - old_logp)` assumes both log-probs are of the same distribution before the first
    step. With another temperature the ratio is far from 1 on every token (`logp_gap` well above 1e-4),
    tokens the sampler made rare look over-sampled, clipping fires on the first minibatch, and the update
    optimises the wrong objective: reward stalls or the policy drifts towards the sampler's temperature.

    ## Example
    ```python
    out = model.generate(ids, do_sample=True, temperature=0.7, output_scores=True)
    old_logp = rollout_logp(out)
    ...
    logp = token_log_probs(model(ids).logits / 1.0, ids)
    ```

    ## Use instead
    ```python
    TEMPERATURE = 0.7
    out = model.generate(ids, do_sample=True, temperature=TEMPERATURE, output_scores=True)
    ...
    logp = token_log_probs(model(ids).logits / TEMPERATURE, ids)
    ```

    ## Fix
    No automatic fix: which of the two temperatures is the intended one is a training decision.

    ## Options
    `[tool.rlguard.names]` `old_logp = [...]` adds your own names for stored sampler log-probs.
    """

    code = SAMPLER_TRAINER_MISMATCH
    triggers = (r"temperature|\btemp\b|multinomial|autocast|Categorical",
                r"log_?probs?|logps?\b|_logp|gather|log_softmax|cross_entropy|def \w*(?:rollout|collect)")

    VALID = [
        Valid(_SAMPLER_SCORES.format(trainer="        z = policy(out.sequences).logits[:, prompts.size(1) - 1:-1] / args.temperature\n"),
              "the trainer divides the policy's logits by the temperature the sampler was given", capability="C6",
              style="functional"),
        Valid("import torch\n"
              "from transformers import GenerationConfig\n"
              "\n"
              "\n"
              "def train(policy, ref_model, opt, prompts, adv, args):\n"
              "    gen_kwargs = {\"max_new_tokens\": 64, \"temperature\": args.temperature, \"do_sample\": True}\n"
              "    config = GenerationConfig(**gen_kwargs)\n"
              "    with torch.no_grad():\n"
              "        out = policy.generate(prompts, generation_config=config, output_logits=True, return_dict_in_generate=True)\n"
              "        seq = out.sequences[:, prompts.size(1):]\n"
              "        a = torch.log_softmax(torch.stack(out.logits, 1), -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
              "        y = ref_model(out.sequences).logits[:, prompts.size(1) - 1:-1] / args.temperature\n"
              "        c = torch.log_softmax(y, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
              "    for _ in range(args.epochs):\n"
              "        z = policy(out.sequences).logits[:, prompts.size(1) - 1:-1]\n"
              "        b = torch.log_softmax(z, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
              "        ratio = torch.exp(b - a)\n"
              "        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + args.beta * (b - c).mean()\n"
              "        opt.zero_grad()\n"
              "        loss.backward()\n"
              "        opt.step()\n",
              "the old log-probs come from the raw logits (output_logits), which the sampler's temperature did not "
              "shape: both sides undivided", capability="C6", style="functional"),
        Valid("TEMP = 0.7\nout = sample(model, prompts, temperature=TEMP)\nold_logp = out['sampler_logp']\n"
              "logp = token_log_probs(model(ids) / TEMP, ids)\n", "both at the same named temperature"),
        Valid("episodes = sample_episodes(model, tasks, temperature=1.0)\nold_logp = batch['sampler_logp']\n"
              "logits = model(ids)\nlogp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])\n",
              "temperature 1.0 sampler and undivided logits"),
        Valid("def evaluate(model, prompts):\n    return model.generate(prompts, temperature=0.2)\n"
              "def train_step(model, ids, old_logp):\n"
              "    logp = model(ids).log_softmax(-1).gather(-1, ids[:, 1:, None])\n",
              "evaluation-only sampling"),
        Valid("out = model.generate(ids, temperature=0.7)\nwith torch.no_grad():\n"
              "    old_logp = token_logp(model(out) / 0.7, out)\nlogp = token_logp(model(out) / 0.7, out)\n",
              "old log-probs recomputed by the trainer at the same temperature"),
        Valid("def rollout(model, tasks, cfg):\n"
              "    return sample_episodes(model, tasks, cfg.group_size, temperature=cfg.temperature)\n",
              "rollout temperature from the config", capability="C6", style="functional"),
        Valid("class Trainer:\n    def __init__(self):\n        self.temperature = 0.9\n"
              "    def rollout(self, prompts):\n        return self.llm.generate(prompts, temperature=self.temperature)\n"
              "    def loss(self, ids, old_logp):\n"
              "        logp = logprobs_from_logits(self.model(ids).logits[:, :-1] / self.temperature, ids[:, 1:])\n",
              "same self attribute", capability="C6", style="class"),
        Valid("params = SamplingParams(temperature=cfg.temperature)\nold_logprobs = rollout_logprobs\n"
              "logits = model(ids).logits / cfg.temperature\n", "same config field", capability="C6", style="script"),
        Valid("old_logp = batch['old_logp']\nlogits = model(ids).logits\n"
              "samples = torch.multinomial(torch.softmax(logits[:, -1] / 0.7, -1), 1)\n",
              "a sampler in view but the trainer's temperature is unknown"),
        Valid(_FUSED_LOSS_ELSEWHERE.format(policy="Tempered(policy, temperature=cfg.temperature)", scored="self.policy"),
              why="the scorer runs the model built with the temperature", capability='C6', style='class'),
        Valid(_FUSED_LOSS_ELSEWHERE.format(policy="policy", scored="model").replace(
            "    def token_logps(self, model, ids, n):\n", "    def token_logps(self, model, ids, n, t=1.0):\n").replace(
            'self.token_logps(model, batch["ids"], batch["n"])',
            'self.token_logps(model, batch["ids"], batch["n"], temperature=self.temperature)'),
              why="its caller hands the scorer the temperature (what the scorer does with it is another question)",
              capability='C6', style='class'),
        Valid('class GroupLearner:\n'
              '    def __init__(self, policy, cfg):\n'
              '        self.policy, self.cfg = policy, cfg\n'
              '        self.gen = GenerationConfig(do_sample=True, temperature=cfg.rollout_temperature)\n'
              '\n'
              '    def token_logps(self, ids, n_resp):\n'
              '        logits = self.policy(ids).logits[:, -n_resp - 1:-1] / self.cfg.rollout_temperature\n'
              '        return selective_log_softmax(logits, ids[:, -n_resp:])\n'
              '\n'
              '    def step(self, batch):\n'
              '        return torch.exp(self.token_logps(batch["ids"], batch["n"]) - batch["old_logp"])\n',
              'same config field on both sides',
              capability='C6', style='class'),
        Valid('def build_sampler(cfg):\n'
              '    return SamplingParams(temperature=cfg["rollout"]["temperature"], logprobs=0)\n'
              '\n'
              '\n'
              'def actor_loss(actor, mb, cfg):\n'
              '    logits = actor(input_ids=mb["input_ids"]).logits\n'
              '    logits.div_(cfg["rollout"]["temperature"])\n'
              '    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb["input_ids"][:, 1:, None])\n'
              '    return -((logp - mb["rollout_log_probs"]).exp() * mb["advantages"]).mean()\n',
              "logits divided in place by the sampler's key",
              capability='C6', style='framework'),
        Valid('def rollout(policy, prompts, tau):\n'
              '    return policy.generate(prompts, do_sample=True, temperature=tau, output_scores=True)\n'
              '\n'
              '\n'
              'def train_step(policy, opt, seqs, behaviour_logp, adv, tau):\n'
              '    logits = policy(seqs, temperature=tau).logits\n'
              '    lp = logits[:, :-1].log_softmax(-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)\n'
              '    loss = -(torch.exp(lp - behaviour_logp) * adv).mean()\n'
              '    loss.backward()\n',
              'the model wrapper takes the temperature',
              capability='C6', style='functional'),
        Valid('out = pi.generate(x, do_sample=True, temperature=args.temp, output_scores=True)\n'
              'seq = out.sequences\n'
              'z = pi(seq).logits[:, x.size(1) - 1:-1] / args.temp\n'
              'lp = z.log_softmax(-1).gather(-1, seq[:, x.size(1):, None]).squeeze(-1)\n',
              'both sides at args.temp',
              capability='C6', style='script'),
        Valid('def token_logprobs(logits, ids, temperature=1.0):\n'
              '    lp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)\n'
              '    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)\n'
              '\n'
              '\n'
              'def score(model, batch, cfg):\n'
              '    logits = model(batch["ids"]).logits\n'
              '    return token_logprobs(logits, batch["ids"], cfg.sampling_temperature)\n',
              "the temperature reaches the helper's temperature parameter",
              capability='C6', style='functional'),
        Valid('class Actor:\n'
              '    def __init__(self, engine, cfg):\n'
              '        self.engine = engine\n'
              '        self.temperature = cfg.temperature\n'
              '\n'
              '    def recompute_logp(self, batch, temperature=None):\n'
              '        logits = self.engine.forward(batch)\n'
              '        t = temperature if temperature is not None else self.temperature\n'
              '        return gather_logprobs(logits, batch["labels"], t)\n'
              '\n'
              '    def update(self, batch):\n'
              '        return self.engine.train_batch(batch, loss_fn=partial(ppo_loss, temperature=self.temperature))\n',
              "the fallback is the class's own temperature",
              capability='C6', style='class'),
        Valid('class Worker:\n'
              '    def __init__(self, model, cfg):\n'
              '        self.model, self.cfg = model, cfg\n'
              '\n'
              '    def _scale(self, logits):\n'
              '        return logits.div_(self.cfg["generation"]["temperature"])\n'
              '\n'
              '    def train(self, mb, loss_fn):\n'
              '        logits = self._scale(self.model(mb["input_ids"]).logits)\n'
              '        loss, _ = loss_fn(logits, mb)\n'
              '        loss.backward()\n'
              '\n'
              '    def old_logprobs(self, mb):\n'
              '        with torch.no_grad():\n'
              '            logits = self._scale(self.model(mb["input_ids"]).logits)\n'
              '            lp = torch.log_softmax(logits.float(), dim=-1)\n'
              '            return lp[:, :-1].gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)\n',
              'both paths scale through the same helper',
              capability='C6', style='framework'),
        Valid('class Worker:\n'
              '    def __init__(self, model, cfg):\n'
              '        self.model, self.cfg = model, cfg\n'
              '\n'
              '    def train(self, mb, loss_fn):\n'
              '        logits = self.model(mb["input_ids"]).logits\n'
              '        logits = logits / self.cfg["generation"]["temperature"]\n'
              '        loss, _ = loss_fn(logits, mb)\n'
              '        loss.backward()\n'
              '\n'
              '    def sft_step(self, mb, opt):\n'
              '        logits = self.model(mb["input_ids"]).logits\n'
              '        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), mb["input_ids"][:, 1:].flatten())\n'
              '        loss.backward()\n',
              'supervised cross-entropy on raw logits next to a temperature-scaled RL path',
              capability='C6', style='class'),
        Valid('from megatron.core.inference.config import InferenceConfig\n'
              'from megatron.core.inference.sampling_params import SamplingParams\n'
              '\n'
              '\n'
              'class Generator:\n'
              '    def setup(self, cfg):\n'
              '        self.icfg = InferenceConfig(max_tokens=cfg["max_tokens"], logprobs_mode="processed_logprobs")\n'
              '\n'
              '    def params(self, cfg):\n'
              '        return SamplingParams(temperature=cfg["temperature"], return_log_probs=True)\n',
              'processed log-probs requested',
              capability='C12', style='class'),
        Valid('from vllm import LLM, SamplingParams\n'
              '\n'
              '\n'
              'def make_engine(cfg):\n'
              '    return LLM(model=cfg.model_path, tensor_parallel_size=cfg.tp)\n'
              '\n'
              '\n'
              'def sample_group(engine, prompts, cfg):\n'
              '    sp = SamplingParams(temperature=1.0, n=cfg.group_size, logprobs=0)\n'
              '    return engine.generate(prompts, sp)\n',
              'sampling at temperature 1: raw and processed log-probs agree',
              capability='C12', style='framework'),
        Valid('import vllm\n'
              '\n'
              'eng = vllm.LLM(ckpt, enforce_eager=True)\n'
              'sp = vllm.SamplingParams(temperature=0.7, max_tokens=512)\n'
              'res = eng.generate(qs, sp)\n',
              "the engine's log-probs are not requested",
              capability='C12', style='script'),
        Valid('res = eng.rollout(x, temperature=0.9)\n'
              'old = res.token_logps.to(dev)\n'
              'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
              '    out = net(input_ids=res.seqs)\n'
              '    lp = F.log_softmax(out.logits[:, :-1], dim=-1).gather(2, res.seqs[:, 1:, None]).squeeze(-1)\n'
              'r = torch.exp(lp - old)\n',
              'log-softmax inside the autocast block',
              capability='C12', style='script'),
        Valid('def ppo_epoch(actor, sampler, prompts, opt):\n'
              '    batch = sampler.generate_batch(prompts, temperature=0.8)\n'
              '    behaviour = batch.logprobs\n'
              '    with torch.autocast(device_type="cuda", dtype=torch.float16):\n'
              '        out = actor(batch.ids, attention_mask=batch.mask)\n'
              '    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)\n'
              '    loss = -((logp - behaviour).exp() * batch.adv).mean()\n'
              '    loss.backward()\n',
              'logits upcast with .float() before the log-softmax',
              capability='C12', style='functional'),
        Valid('class PPO:\n'
              '    def step(self, prompts):\n'
              '        traj = self.engine.rollout(prompts, temperature=self.cfg.temperature)\n'
              '        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):\n'
              '            res = self.actor(traj.ids)\n'
              '        old_lp = (res.logits[:, :-1] / self.cfg.temperature).log_softmax(-1).gather(-1, traj.ids[:, 1:, None])\n'
              '        with torch.autocast("cuda", dtype=torch.bfloat16):\n'
              '            res = self.actor(traj.ids)\n'
              '        new_lp = (res.logits[:, :-1] / self.cfg.temperature).log_softmax(-1).gather(-1, traj.ids[:, 1:, None])\n'
              '        ratio = torch.exp(new_lp - old_lp)\n'
              '        (-(ratio * traj.adv).mean()).backward()\n',
              'old and new log-probs computed the same way by the trainer',
              capability='C12', style='class'),
        Valid('lp = torch.log_softmax(net(seq).logits[:, :-1] / args.temperature, -1).gather(-1, seq[:, 1:, None]).squeeze(-1)\n'
              'ratio = torch.exp(lp - old)\n',
              'the logits are divided before the log-softmax',
              capability='C9', style='script'),
        Valid('def token_logps(model, ids, temperature):\n'
              '    full = model(ids).logits[:, :-1].log_softmax(-1)\n'
              '    full = (full / temperature).log_softmax(-1)\n'
              '    return full.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n',
              'full-vocabulary log-probs renormalised by a second log-softmax',
              capability='C9', style='functional'),
        Valid('class Scorer:\n'
              '    def logps(self, ids):\n'
              '        dist = torch.distributions.Categorical(logits=self.policy(ids).logits[:, :-1] / self.temp)\n'
              '        return dist.log_prob(ids[:, 1:])\n',
              'the Categorical is built from divided logits',
              capability='C9', style='class'),
        Valid('def scale(logits, cfg):\n'
              '    return logits.div_(cfg["sampling"]["temperature"])\n'
              '\n'
              '\n'
              'class TokenLogprobs:\n'
              '    def __call__(self, logits, ids):\n'
              '        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n'
              '\n'
              '\n'
              'class PolicyLoss:\n'
              '    def __init__(self, loss_fn):\n'
              '        self.loss_fn = loss_fn\n'
              '\n'
              '    def __call__(self, logits, batch):\n'
              '        return self.loss_fn(logits, batch)\n'
              '\n'
              '\n'
              'def run_head(model, head, batch, cfg):\n'
              '    logits = model(batch["ids"]).logits\n'
              '    if isinstance(head, (TokenLogprobs, PolicyLoss)):\n'
              '        logits = scale(logits, cfg)\n'
              '    if isinstance(head, PolicyLoss):\n'
              '        return head(logits, batch)\n'
              '    return head(logits, batch["ids"])\n',
              "the temperature is applied for the loss consumer too", style="functional"),
        Valid('def token_logprobs(logits, ids, scale):\n'
              '    logits.div_(scale)\n'
              '    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n'
              '\n'
              '\n'
              'def score(model, batch, cfg):\n'
              '    return token_logprobs(model(batch["ids"]).logits, batch["ids"], cfg.sampling_temperature)\n',
              "the helper divides by its own name for the temperature",
              capability="C6", style="functional"),
        Valid('class Agent:\n'
              '    def act(self, obs):\n'
              '        logits = self.policy(obs).logits[:, -1]\n'
              '        return torch.distributions.Categorical(logits=logits / 0.8).sample()\n'
              '\n'
              '    def update(self, obs, acts, old_logp, adv):\n'
              '        dist = torch.distributions.Categorical(logits=self.policy(obs).logits[:, -1] / 0.8)\n'
              '        ratio = torch.exp(dist.log_prob(acts) - old_logp)\n'
              '        (-(ratio * adv).mean()).backward()\n',
              "both distributions built from logits divided by 0.8",
              capability="C12", style="class"),
        Valid("def token_logps(model, ids, temperature=1.0):\n"
              "    z = model(ids).logits[:, :-1] / temperature\n"
              "    return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n",
              "the temperature parameter divides the logits", capability="C12", style="functional"),
        Valid("def token_logps(model, ids, temperature=None):\n"
              "    if temperature is None:\n"
              "        temperature = 1.0\n"
              "    return logprobs_from_logits(model(ids).logits[:, :-1], ids[:, 1:], temperature=temperature)\n",
              "the temperature parameter is handed to the log-prob helper", capability="C12", style="functional"),
        Valid("class Actor:\n"
              "    def micro(self, batch, temperature, packed):\n"
              "        if packed:\n"
              "            z = self.actor_module(batch['packed_ids']).logits.squeeze(0)\n"
              "            z.div_(temperature)\n"
              "            lp = logprobs_from_logits(z, batch['packed_labels'])\n"
              "        else:\n"
              "            z = self.actor_module(batch['ids']).logits[:, :-1]\n"
              "            z.div_(temperature)\n"
              "            lp = logprobs_from_logits(z, batch['ids'][:, 1:])\n"
              "        return lp\n",
              "both paths divide their logits by the temperature", capability="C12", style="class"),
    ]
    INVALID = [
        Invalid(_FUSED_LOSS_ELSEWHERE.format(policy="policy", scored="model"), line=10,
                why="the temperature handed to a fused loss built for another path does not reach the logits this "
                    "scorer computes from its own forward", capability='C6', style='class'),
        Invalid("import torch\n"
                "from transformers import GenerationConfig\n"
                "\n"
                "\n"
                "def train(policy, opt, prompts, adv, args):\n"
                "    gen_kwargs = {\"max_new_tokens\": 64, \"temperature\": args.temperature, \"do_sample\": True}\n"
                "    config = GenerationConfig(**gen_kwargs)\n"
                "    with torch.no_grad():\n"
                "        out = policy.generate(prompts, generation_config=config, output_scores=True, return_dict_in_generate=True)\n"
                "        seq = out.sequences[:, prompts.size(1):]\n"
                "        a = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
                "    for _ in range(args.epochs):\n"
                "        z = policy(out.sequences).logits[:, prompts.size(1) - 1:-1]\n"
                "        b = torch.log_softmax(z, -1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)\n"
                "        ratio = torch.exp(b - a)\n"
                "        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()\n"
                "        opt.zero_grad()\n"
                "        loss.backward()\n"
                "        opt.step()\n", line=14,
                why="the sampler's temperature is an entry of the dict handed to GenerationConfig as **kwargs; the "
                    "trainer never divides its logits", capability="C3", style="functional"),
        Invalid(_SAMPLER_SCORES.format(trainer="        z = policy(out.sequences).logits[:, prompts.size(1) - 1:-1]\n"), line=16,
                why="the old side of the ratio is the log-softmax of the scores generate returned, shaped by the "
                    "temperature handed to the sampler through a **kwargs dict; the trainer's logits are undivided (the "
                    "reference's are divided, so the module does apply a temperature elsewhere)", capability="C6",
                style="functional"),
        Invalid("SAMPLER_TEMP = 0.7\nTRAIN_TEMP = 1.0\n"
                "episodes = sample(model, prompts, temperature=SAMPLER_TEMP)\nold_logp = batch['sampler_logp']\n"
                "logits = model(ids).logits / TRAIN_TEMP\n"
                "logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])\n", line=5,
                why="two module constants"),
        Invalid("out = model.generate(ids, do_sample=True, temperature=0.7)\nold_logprobs = out.logprobs\n"
                "logits = model(out.sequences).logits\n"
                "logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, out.sequences[:, 1:, None])\n", line=4,
                why="logits not divided while the sampler ran at 0.7", preview=True),
        Invalid("params = SamplingParams(temperature=0.6, logprobs=0)\nrollout_logp = collect(params)\n"
                "def train(model, ids, rollout_logp):\n    logits = model(ids).logits\n    logits = logits / 0.8\n"
                "    logp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])\n", line=5, why="0.6 vs 0.8"),
        Invalid("SAMPLER_TEMPERATURE = 0.7\n\ndef rollout(model, tasks, cfg, generator):\n"
                "    episodes = sample_episodes(model, tasks, cfg.spec, cfg.group_size,\n"
                "                               temperature=SAMPLER_TEMPERATURE, generator=generator)\n"
                "    return collate(episodes, cfg.group_size)\n", line=5,
                why="hard-coded rollout temperature bypassing the config"),
        Invalid("@dataclass\nclass Config:\n    sample_temperature: float = 0.7\n    temperature: float = 1.0\n"
                "cfg = Config()\nbatch = rollout(policy, prompts, temperature=cfg.sample_temperature)\n"
                "old_log_probs = batch['old_log_probs']\n"
                "log_probs = token_log_probs(policy(batch['ids']) / cfg.temperature, batch['ids'])\n", line=8,
                why="config-class defaults differ", capability="C6", style="script", preview=True),
        Invalid("class Worker:\n    def __init__(self):\n        self.sample_temp = 0.5\n"
                "    def step(self, ids, behavior_logp):\n"
                "        out = self.actor.generate(ids, temperature=self.sample_temp)\n"
                "        logits = self.actor(ids)\n"
                "        dist = torch.distributions.Categorical(logits=logits[:, :-1])\n"
                "        logp = dist.log_prob(ids[:, 1:])\n", line=8, why="undivided Categorical"),
        Invalid("def sample(model, ids, n):\n    for _ in range(n):\n"
                "        probs = torch.softmax(model(ids)[:, -1] / 0.7, -1)\n"
                "        ids = torch.cat([ids, torch.multinomial(probs, 1)], 1)\n    return ids\n"
                "def loss(model, ids, sampler_logp):\n"
                "    logp = model(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n",
                line=7, why="sampling function divides by 0.7, trainer does not"),
        Invalid('class GroupLearner:\n'
                '    def __init__(self, policy, cfg):\n'
                '        self.policy = policy\n'
                '        self.gen = GenerationConfig(do_sample=True, temperature=cfg.rollout_temperature)\n'
                '\n'
                '    def token_logps(self, ids, n_resp):\n'
                '        logits = self.policy(ids).logits[:, -n_resp - 1:-1]\n'
                '        return selective_log_softmax(logits, ids[:, -n_resp:])\n'
                '\n'
                '    def step(self, batch):\n'
                '        logp = self.token_logps(batch["ids"], batch["n"])\n'
                '        return torch.exp(logp - batch["old_logp"])\n',
                line=8, why="generation config samples at a config field; the trainer's logits are never divided",
                capability='C6', style='class'),
        Invalid('def build_sampler(cfg):\n'
                '    return SamplingParams(temperature=cfg["rollout"]["temperature"], logprobs=0)\n'
                '\n'
                '\n'
                'def actor_loss(actor, mb):\n'
                '    out = actor(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])\n'
                '    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)\n'
                '    logp = logp.gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)\n'
                '    ratio = (logp - mb["rollout_log_probs"]).exp()\n'
                '    return -(ratio * mb["advantages"]).mean()\n',
                line=8, why="sampler temperature under a dict key of the config; the actor's log-probs are taken at 1",
                capability='C6', style='framework'),
        Invalid('def rollout(policy, prompts, tau):\n'
                '    return policy.generate(prompts, do_sample=True, temperature=tau, output_scores=True)\n'
                '\n'
                '\n'
                'def train_step(policy, opt, seqs, behaviour_logp, adv):\n'
                '    logits = policy(seqs).logits\n'
                '    lp = logits[:, :-1].log_softmax(-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)\n'
                '    loss = -(torch.exp(lp - behaviour_logp) * adv).mean()\n'
                '    loss.backward()\n'
                '    opt.step()\n',
                line=7, why='sampler temperature is a caller parameter; the trainer scores undivided logits',
                capability='C6', style='functional'),
        Invalid('out = pi.generate(x, do_sample=True, temperature=args.temp, output_scores=True)\n'
                'seq = out.sequences\n'
                'z = pi(seq).logits[:, x.size(1) - 1:-1]\n'
                'lp = z.log_softmax(-1).gather(-1, seq[:, x.size(1):, None]).squeeze(-1)\n',
                line=4, why='terse script: generate at args.temp, score at temperature 1',
                capability='C6', style='script'),
        Invalid('def token_logprobs(logits, ids, lengths=None):\n'
                '    lp = torch.log_softmax(logits[:, :-1], dim=-1)\n'
                '    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)\n'
                '\n'
                '\n'
                'def score(model, batch, cfg):\n'
                '    logits = model(batch["ids"]).logits\n'
                '    return token_logprobs(logits, batch["ids"], cfg.sampling_temperature)\n',
                line=3, why="the caller's temperature lands in the helper's `lengths` slot and is never applied",
                capability='C6', style='functional'),
        Invalid('class Actor:\n'
                '    def __init__(self, engine, cfg):\n'
                '        self.engine = engine\n'
                '        self.temperature = cfg.temperature\n'
                '\n'
                '    def recompute_logp(self, batch, temperature=None):\n'
                '        logits = self.engine.forward(batch)\n'
                '        return gather_logprobs(logits, batch["labels"], temperature or 1.0)\n'
                '\n'
                '    def update(self, batch):\n'
                '        return self.engine.train_batch(batch, loss_fn=partial(ppo_loss, temperature=self.temperature))\n',
                line=8, why='optional temperature falls back to 1 while the class trains at self.temperature',
                capability='C6', style='class'),
        Invalid('class Worker:\n'
                '    def __init__(self, model, cfg):\n'
                '        self.model, self.cfg = model, cfg\n'
                '\n'
                '    def train(self, mb, loss_fn):\n'
                '        logits = self.model(mb["input_ids"]).logits\n'
                '        logits = logits / self.cfg["generation"]["temperature"]\n'
                '        loss, _ = loss_fn(logits, mb)\n'
                '        loss.backward()\n'
                '\n'
                '    def old_logprobs(self, mb):\n'
                '        with torch.no_grad():\n'
                '            logits = self.model(mb["input_ids"]).logits\n'
                '            lp = torch.log_softmax(logits.float(), dim=-1)\n'
                '            return lp[:, :-1].gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)\n',
                line=15, why='train divides by the generation temperature, the old-logp recompute does not',
                capability='C6', style='framework'),
        Invalid('from megatron.core.inference.config import InferenceConfig\n'
                'from megatron.core.inference.sampling_params import SamplingParams\n'
                '\n'
                '\n'
                'class Generator:\n'
                '    def setup(self, cfg):\n'
                '        self.icfg = InferenceConfig(max_tokens=cfg["max_tokens"], block_size_tokens=256)\n'
                '\n'
                '    def params(self, cfg):\n'
                '        return SamplingParams(temperature=cfg["temperature"], return_log_probs=True)\n',
                line=7, why='megatron-core InferenceConfig without processed log-probs, sampling at a config temperature',
                capability='C12', style='class'),
        Invalid('from vllm import LLM, SamplingParams\n'
                '\n'
                '\n'
                'def make_engine(cfg):\n'
                '    return LLM(model=cfg.model_path, tensor_parallel_size=cfg.tp, gpu_memory_utilization=0.5)\n'
                '\n'
                '\n'
                'def sample_group(engine, prompts, cfg):\n'
                '    sp = SamplingParams(temperature=cfg.temperature, n=cfg.group_size, logprobs=0)\n'
                '    outs = engine.generate(prompts, sp)\n'
                '    return [{"text": c.text, "rollout_logp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]}\n'
                '            for o in outs for c in o.outputs]\n',
                line=5, why='vLLM engine built without logprobs_mode while its log-probs become rollout log-probs',
                capability='C12', style='framework'),
        Invalid('import vllm\n'
                '\n'
                'eng = vllm.LLM(ckpt, enforce_eager=True)\n'
                'sp = vllm.SamplingParams(temperature=0.7, max_tokens=512, logprobs=1)\n'
                'res = eng.generate(qs, sp)\n',
                line=3, why='vLLM at 0.7 with raw log-probs',
                capability='C12', style='script'),
        Invalid('res = eng.rollout(x, temperature=0.9)\n'
                'old = res.token_logps.to(dev)\n'
                'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                '    out = net(input_ids=res.seqs)\n'
                'lp = F.log_softmax(out.logits[:, :-1], dim=-1).gather(2, res.seqs[:, 1:, None]).squeeze(-1)\n'
                'r = torch.exp(lp - old)\n',
                line=5, why='log-softmax of bf16 logits after the autocast block, compared with sampler log-probs',
                capability='C12', style='script'),
        Invalid('def ppo_epoch(actor, sampler, prompts, opt, amp):\n'
                '    batch = sampler.generate_batch(prompts, temperature=0.8)\n'
                '    behaviour = batch.logprobs\n'
                '    with torch.autocast(device_type="cuda", dtype=torch.float16):\n'
                '        out = actor(batch.ids, attention_mask=batch.mask)\n'
                '    logp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)\n'
                '    log_ratio = logp - behaviour\n'
                '    loss = -(log_ratio.exp() * batch.adv).mean()\n'
                '    loss.backward()\n',
                line=6, why='fp16 autocast forward, log-softmax outside, behaviour log-probs from the sampler',
                capability='C12', style='functional'),
        Invalid('class PPO:\n'
                '    def step(self, prompts):\n'
                '        traj = self.engine.rollout(prompts, temperature=self.cfg.temperature)\n'
                '        old_lp = traj.logps\n'
                '        with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                '            res = self.actor(traj.ids)\n'
                '        new_lp = (res.logits[:, :-1] / self.cfg.temperature).log_softmax(-1).gather(-1, traj.ids[:, 1:, None])\n'
                '        ratio = torch.exp(new_lp - old_lp)\n'
                '        (-(ratio * traj.adv).mean()).backward()\n',
                line=7, why="class trainer: log-softmax outside autocast against the engine's log-probs",
                capability='C12', style='class'),
        Invalid('lp = torch.log_softmax(net(seq).logits[:, :-1], -1).gather(-1, seq[:, 1:, None]).squeeze(-1)\n'
                'lp = lp / args.temperature\n'
                'ratio = torch.exp(lp - old)\n',
                line=2, why='terse script: gathered log-probs divided by the temperature',
                capability='C9', style='script'),
        Invalid('def token_logps(model, ids, temperature):\n'
                '    logp = model(ids).logits[:, :-1].log_softmax(-1)\n'
                '    tok = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)\n'
                '    tok /= temperature\n'
                '    return tok\n',
                line=4, why='in-place division of gathered token log-probs',
                capability='C9', style='functional'),
        Invalid('class Scorer:\n'
                '    def logps(self, ids):\n'
                '        dist = torch.distributions.Categorical(logits=self.policy(ids).logits[:, :-1])\n'
                '        return dist.log_prob(ids[:, 1:]) / self.temp\n',
                line=4, why="a Categorical's log_prob divided by the temperature",
                capability='C9', style='class'),
        Invalid('def scale(logits, cfg):\n'
                '    return logits.div_(cfg["sampling"]["temperature"])\n'
                '\n'
                '\n'
                'class TokenLogprobs:\n'
                '    def __call__(self, logits, ids):\n'
                '        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n'
                '\n'
                '\n'
                'class PolicyLoss:\n'
                '    def __init__(self, loss_fn):\n'
                '        self.loss_fn = loss_fn\n'
                '\n'
                '    def __call__(self, logits, batch):\n'
                '        return self.loss_fn(logits, batch)\n'
                '\n'
                '\n'
                'def run_head(model, head, batch, cfg):\n'
                '    logits = model(batch["ids"]).logits\n'
                '    if isinstance(head, TokenLogprobs):\n'
                '        logits = scale(logits, cfg)\n'
                '    if isinstance(head, PolicyLoss):\n'
                '        return head(logits, batch)\n'
                '    return head(logits, batch["ids"])\n',
                line=23, why="logits scaled only for the log-prob consumer; the loss branch gets them raw",
                style="functional", preview=True),
        Invalid('class Agent:\n'
                '    def act(self, obs):\n'
                '        logits = self.policy(obs).logits[:, -1]\n'
                '        return torch.distributions.Categorical(logits=logits / 0.8).sample()\n'
                '\n'
                '    def update(self, obs, acts, old_logp, adv):\n'
                '        dist = torch.distributions.Categorical(logits=self.policy(obs).logits[:, -1])\n'
                '        ratio = torch.exp(dist.log_prob(acts) - old_logp)\n'
                '        (-(ratio * adv).mean()).backward()\n',
                line=8, why="actions sampled from Categorical(logits / 0.8), trained on the raw Categorical",
                capability="C12", style="class"),
        Invalid("def token_logps(model, ids, temperature=1.0):\n"
                "    if temperature <= 0:\n"
                "        raise ValueError(temperature)\n"
                "    z = model(ids).logits[:, :-1]\n"
                "    return torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)\n", line=5,
                why="the function takes the sampling temperature and checks it, but its log-probs never see it",
                capability="C12", style="functional"),
        Invalid("class Actor:\n"
                "    def micro(self, batch, temperature, packed):\n"
                "        if packed:\n"
                "            z = self.actor_module(batch['packed_ids']).logits.squeeze(0)\n"
                "            z.div_(temperature)\n"
                "            lp = logprobs_from_logits(z, batch['packed_labels'])\n"
                "        else:\n"
                "            z = self.actor_module(batch['ids']).logits[:, :-1]\n"
                "            lp = logprobs_from_logits(z, batch['ids'][:, 1:])\n"
                "        return lp\n", line=9,
                why="the packed path divides its logits by the temperature, the padded path does not",
                capability="C12", style="class"),
    ]

    def check(self, ctx: Analysis) -> Iterator[Violation]:
        samplers = _sampler_functions(ctx)
        sampler_temps = list(_sampler_temperatures(ctx, samplers))
        # a training rollout that hard-codes its temperature, bypassing the config
        for call, value_expr, value in sampler_temps:
            if value is None or value == 1.0 or value == 0.0:
                continue
            if not _hard_coded(ctx, value_expr):
                continue
            func = ctx.enclosing_function(call)
            if func is None or not ROLLOUT_FUNCTION.fullmatch(func.name.value):
                continue
            configs = _config_objects(ctx, call)
            if configs and not any(_reads_temperature(ctx, c) for c in configs):
                yield Violation(value_expr, f"the rollout samples at a hard-coded temperature {value:g} while its "
                                            f"other settings come from `{configs[0]}`, whose temperature the "
                                            "trainer uses for its log-probs; pass the config's temperature "
                                            "to the sampler")
        reported: set[int] = set()
        yield from _symbolic(ctx, samplers, sampler_temps, reported)
        yield from _sibling(ctx, samplers, reported)
        yield from _misplaced(ctx, samplers, reported)
        yield from _fallback(ctx, reported)
        yield from _autocast(ctx, samplers, reported)
        yield from _engine_logprobs_mode(ctx)
        yield from _logp_divided(ctx)
        yield from _guarded_scaling(ctx, reported)
        yield from _unapplied_parameter(ctx, reported)
        yield from _undivided_against_sampler(ctx, samplers, sampler_temps, reported)
        known = [(c, e, v) for c, e, v in sampler_temps if v is not None]
        if not known or not _old_logp_from_sampler(ctx):
            return
        for site, divisor in _trainer_sites(ctx, samplers):
            if id(site) in reported:
                continue
            if divisor is None:
                bad = [(c, v) for c, _, v in known if v not in (1.0, 0.0)]
                if bad:
                    call, value = bad[0]
                    yield Violation(site, f"the trainer's log-probs use logits not divided by the temperature, "
                                          f"but the sampler (line {_line(ctx, call)}) samples at temperature "
                                          f"{value:g} and its log-probs are the old log-probs; divide the "
                                          f"logits by the sampler's temperature ({value:g})")
                continue
            train_value = _resolve(ctx, divisor)
            if train_value is None:
                continue
            for call, _, value in known:
                if value != train_value and value != 0.0:
                    yield Violation(divisor, f"the trainer divides the logits by temperature {train_value:g} but "
                                             f"the sampler (line {_line(ctx, call)}) samples at {value:g} and "
                                             "its log-probs are the old log-probs; use one temperature for both")
                    break


def _line(ctx: Analysis, node: cst.CSTNode) -> str:
    # positions are not computed for rules; count the newlines of the code before the node instead
    code = ctx.module.code
    snippet = ctx.code(node)
    index = code.find(snippet)
    return str(code.count("\n", 0, index) + 1) if index >= 0 else "?"


def _callee_name(call: cst.Call) -> str | None:
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else None


def _sampler_functions(ctx: Analysis) -> set[int]:
    found = set()
    for call in ctx.nodes(cst.Call):
        name = ctx.call_name(call) or ""
        callee = _callee_name(call) or ""
        if name in SAMPLING_OPS or callee == "multinomial" or callee == "sample" and _categorical(ctx, call):
            func = ctx.enclosing_function(call)
            if func is not None:
                found.add(id(func))
    return found


def _categorical(ctx: Analysis, call: cst.Call) -> bool:
    """``Categorical(logits=...).sample()`` or ``dist.sample()`` with ``dist = Categorical(...)``."""
    receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
    if isinstance(receiver, cst.Name):
        defs = plain_reaching(ctx, receiver.value, receiver)
        receiver = defs[0].value if len(defs) == 1 else None
    return isinstance(receiver, cst.Call) and (ctx.call_name(receiver) or _callee_name(receiver) or "").endswith(
        "Categorical")


def _is_eval(ctx: Analysis, call: cst.Call) -> bool:
    func = ctx.enclosing_function(call)
    if func is not None and EVAL_NAME.fullmatch(func.name.value):
        return True
    callee = _callee_name(call) or ""
    if EVAL_NAME.fullmatch(callee):
        return True
    for kw, bad in (("do_sample", "False"), ("greedy", "True")):
        value = argument(call, None, kw)
        if isinstance(value, cst.Name) and value.value == bad:
            return True
    return False


def _sampler_temperatures(ctx: Analysis, samplers: set[int]):
    """(call or division, temperature expression, value or None) for each sampler temperature in view."""
    for call in ctx.nodes(cst.Call):
        callee = _callee_name(call)
        if callee is None:
            continue
        defs = ctx.index.functions.get(callee, []) if isinstance(call.func, cst.Name) else []
        in_module_sampler = len(defs) == 1 and id(defs[0]) in samplers
        if not (SAMPLER_CALL.fullmatch(callee) or in_module_sampler) or _is_eval(ctx, call):
            continue
        expr = None
        for kw in TEMPERATURE_KEYWORDS:
            # a keyword, or an entry of a dict literal handed in as `**kwargs` (`GenerationConfig(**gen_kwargs)`)
            expr = expr or argument(call, None, kw) or splat_entry(ctx, call, kw)
        if expr is None and in_module_sampler:
            params = [p.name.value for p in defs[0].params.params]
            for pos, p in enumerate(params):
                if p in TEMPERATURE_KEYWORDS:
                    expr = argument(call, pos, None)
        if expr is not None:
            yield call, expr, _resolve(ctx, expr)
    for op in ctx.nodes(cst.BinaryOperation):
        if not isinstance(op.operator, cst.Divide):
            continue
        func = ctx.enclosing_function(op)
        if func is None or id(func) not in samplers or EVAL_NAME.fullmatch(func.name.value):
            continue
        value = _resolve(ctx, op.right)
        if value is not None and _is_logits(ctx, op.left):
            yield op, op.right, value


def _is_logits(ctx: Analysis, expr: cst.BaseExpression, depth: int = 6) -> bool:
    while depth > 0:
        depth -= 1
        if isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call):
            if is_model_call(ctx, expr):
                return True
            return False
        elif isinstance(expr, (cst.Name, cst.Attribute)):
            name = dotted_name(expr) or ""
            if ctx.names.is_role(name.rsplit(".", 1)[-1], "logits"):
                return True
            if isinstance(expr, cst.Attribute) and not name.startswith("self."):
                expr = expr.value
                continue
            assigns = plain_reaching(ctx, name, expr) if name else []
            if len(assigns) != 1 or assigns[0].value is None:
                return False
            expr = assigns[0].value
        else:
            return False
    return False


def _resolve(ctx: Analysis, expr: cst.BaseExpression, depth: int = 6) -> float | None:
    """The numeric value of a temperature: a literal, or a name bound to one (in the function, the module,
    a ``self.`` attribute, or a class-level default of a config class)."""
    if depth < 0 or expr is None:
        return None
    if isinstance(expr, (cst.Float, cst.Integer)):
        return float(expr.evaluated_value)
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        inner = _resolve(ctx, expr.expression, depth - 1)
        return None if inner is None else -inner
    key = dotted_name(expr)
    if key is None:
        return None
    if isinstance(expr, cst.Name) or key.startswith("self.") and key.count(".") == 1:
        assigns = [a for a in all_assignments(ctx, key, expr) if a.kind == "assign"]
        values = {_resolve(ctx, a.value, depth - 1) if a.value is not None and a.element is None else None
                  for a in assigns}
        if len(values) == 1:
            return values.pop()
        if not assigns and key.startswith("self."):
            return _class_default(ctx, key.split(".")[1], depth - 1)
        return None
    if isinstance(expr, cst.Attribute) and CONFIG_OBJECT.fullmatch(dotted_name(expr.value) or ""):
        return _class_default(ctx, expr.attr.value, depth - 1)
    return None


def _class_default(ctx: Analysis, attr: str, depth: int) -> float | None:
    """The default of field ``attr`` in the module's config classes (a default that names another config field
    is resolved with the depth left: `temperature: float = cfg.temperature` must not loop)."""
    values = set()
    for cls in ctx.nodes(cst.ClassDef):
        for stmt in cls.body.body:
            if not isinstance(stmt, cst.SimpleStatementLine):  # methods and blocks hold no field defaults
                continue
            for small in stmt.body:
                if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) \
                        and small.target.value == attr and small.value is not None:
                    values.add(_resolve(ctx, small.value, depth))
                elif isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(
                        small.targets[0].target, cst.Name) and small.targets[0].target.value == attr:
                    values.add(_resolve(ctx, small.value, depth))
    for call in ctx.nodes(cst.Call):  # Config(temperature=0.7) overrides a default
        value = argument(call, None, attr)
        if value is not None and isinstance(call.func, cst.Name) and call.func.value in {
                c.name.value for c in ctx.nodes(cst.ClassDef)}:
            values.add(_resolve(ctx, value, depth))
    return values.pop() if len(values) == 1 else None


def _hard_coded(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Float, cst.Integer)):
        return True
    if isinstance(expr, cst.Name):
        assigns = all_assignments(ctx, expr.value, expr)
        return bool(assigns) and all(ctx.enclosing_function(a.stmt) is None for a in assigns)
    return False


def _config_objects(ctx: Analysis, call: cst.Call) -> list[str]:
    found = []
    for arg in call.args:
        value = arg.value
        if isinstance(value, cst.Attribute):
            base = dotted_name(value.value)
            if base and CONFIG_OBJECT.fullmatch(base) and base not in found:
                found.append(base)
    return found


def _reads_temperature(ctx: Analysis, config: str) -> bool:
    for attr in ctx.nodes(cst.Attribute):
        if attr.attr.value in TEMPERATURE_KEYWORDS or "temp" in attr.attr.value.lower():
            if dotted_name(attr.value) == config:
                return True
    return False


def _old_logp_from_sampler(ctx: Analysis) -> bool:
    """An old-logp value is read in this module and never recomputed from the model here."""
    seen = False
    for node in ctx.nodes(cst.Name):
        if ctx.names.is_role(node.value, "old_logp"):
            seen = True
            break
    if not seen:
        for s in ctx.nodes(cst.SimpleString):
            value = s.evaluated_value
            if isinstance(value, str) and value.isidentifier() and ctx.names.is_role(value, "old_logp"):
                seen = True
                break
    if not seen:
        return False
    for stmt in ctx.nodes(cst.Assign):
        for target in stmt.targets:
            name = dotted_name(target.target)
            if isinstance(target.target, cst.Subscript):
                name = key_name(target.target)
            if name and ctx.names.is_role(name.rsplit(".", 1)[-1], "old_logp") and RECOMPUTE.search(
                    ctx.code(stmt.value)):
                return False
    return True


def _trainer_sites(ctx: Analysis, samplers: set[int], no_grad: bool = False):
    """(site, divisor or None) for each log-prob computation of the trainer whose logits come from a model
    (``no_grad``: also those computed without autograd, such as a recomputation of the old log-probs)."""
    gathers = {id(site.node): site for site in gather_sites(ctx)}  # the facet RLG001/RLG012 share
    for call in ctx.nodes(cst.Call):
        site = gathers.get(id(call))
        if site is None and not LOGP_CALL.fullmatch(_callee_name(call) or ""):
            continue  # neither a gather nor a log-prob helper: the cheap test first
        func = ctx.enclosing_function(call)
        if func is not None and (id(func) in samplers or EVAL_NAME.fullmatch(func.name.value)):
            continue
        if not no_grad and grad_context(ctx).enabled(call) is False:
            continue
        logits = site.logits if site is not None else None
        if logits is None:
            callee = _callee_name(call) or ""
            if LOGP_CALL.fullmatch(callee) and call.args and not isinstance(call.func, cst.Name) \
                    or (isinstance(call.func, cst.Name) and LOGP_CALL.fullmatch(callee)
                        and len(ctx.index.functions.get(callee, [])) != 1):
                logits = call.args[0].value if call.args else None
        if logits is None:
            continue
        reached, divisor = logits_divisor(ctx, logits, call)
        if reached:
            yield call, divisor


def _loss_sites(ctx: Analysis, samplers: set[int]):
    """(call, logits argument, divisor or None) for each opaque loss callable (a parameter or attribute, not a
    library function) handed a model's logits whose result is ``.backward()``-ed."""
    for call in loss_inputs(ctx):
        func = ctx.enclosing_function(call)
        if func is None or id(func) in samplers or ctx.call_name(call) is not None and "." in (
                ctx.call_name(call) or "") and ctx.is_module_function(call):
            continue
        if ctx.callee(call) is not None or not isinstance(call.func, (cst.Name, cst.Attribute)):
            continue
        name = dotted_name(call.func) or ""
        if isinstance(call.func, cst.Name):
            defs = ctx.flow.reaching(name, call)
            if not defs or any(d.kind in ("import", "def") for d in defs):
                continue  # a plain name must be a callable handed in (``loss_fn``), not an unseen import
        for arg in call.args[:1]:
            reached, divisor = logits_divisor(ctx, arg.value, call)
            if reached:
                yield call, arg.value, divisor


def _sites(ctx: Analysis, samplers: set[int], no_grad: bool = False):
    """Every trainer log-prob site: (site, logits chain or None, divisor or None)."""
    for site, divisor in _trainer_sites(ctx, samplers, no_grad):
        yield site, None, divisor
    for call, logits, divisor in _loss_sites(ctx, samplers):
        yield call, logits, divisor


def _site_logits(ctx: Analysis, site: cst.Call) -> cst.BaseExpression | None:
    found = gather_site(ctx, site)
    if found is not None and found.logits is not None:
        return found.logits
    return site.args[0].value if site.args else None


def _scaled_logits(ctx: Analysis, samplers: set[int]):
    """(division, model, divisor): a model's logits divided by a temperature symbol outside a sampler
    (``logits / cfg.temperature``, ``logits.div_(self.cfg["generation"]["temperature"])``, ``logits /= t``)."""
    for node in ctx.nodes(cst.BinaryOperation, cst.Call, cst.AugAssign):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide):
            left, divisor = node.left, node.right
        elif isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
            left, divisor = node.target, node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
                node.func.attr.value in ("div", "div_") and node.args:
            left, divisor = node.func.value, node.args[0].value
        else:
            continue
        func = ctx.enclosing_function(node)
        if func is None or id(func) in samplers or not temperature_expr(divisor) or _resolve(ctx, divisor) is not None:
            continue
        ref = model_role(ctx, left)
        if ref is not None and ref.role in ("policy", "model"):
            yield node, ref, divisor


def _policy_site(ctx: Analysis, site: cst.Call, logits: cst.BaseExpression | None) -> bool:
    """The site scores the policy: its logits come from a model that is not a reference, critic or reward model."""
    if logits is None:
        logits = _site_logits(ctx, site)
    ref = model_role(ctx, logits) if logits is not None else None
    return ref is not None and ref.role in ("policy", "model")


def _samples_for_training(ctx: Analysis) -> bool:
    """Evidence that sampled log-probs matter to the trainer: an old-logp value is read in the module, or a
    sampling call asks for the sampler's log-probs or scores."""
    for node in ctx.nodes(cst.Name):
        if ctx.names.is_role(node.value, "old_logp"):
            return True
    for s in ctx.nodes(cst.SimpleString):
        value = s.evaluated_value
        if isinstance(value, str) and value.isidentifier() and ctx.names.is_role(value, "old_logp"):
            return True
    for call in ctx.nodes(cst.Call):
        if not is_sampling_call(call):
            continue
        for kw in ("output_scores", "return_log_probs", "return_logprobs", "output_logprobs"):
            if literal_bool(argument(call, None, kw)) is True:
                return True
        value = argument(call, None, "logprobs")
        if value is not None and not (isinstance(value, cst.Name) and value.value in ("None", "False")):
            return True
    return False


def _symbolic(ctx: Analysis, samplers: set[int], sampler_temps, reported: set[int]):
    """The sampler's temperature is a symbol (a config field, attribute, parameter) that is not provably 1, and
    the trainer scores the policy's logits undivided in a module that applies no temperature anywhere."""
    symbols = [(c, e) for c, e, v in sampler_temps if v is None and isinstance(c, cst.Call)
               and _symbol(ctx, e)]
    if not symbols or any(v == 1.0 for _, _, v in sampler_temps):
        return
    if not _samples_for_training(ctx):
        return
    anywhere = applies_temperature(ctx)
    call, expr = symbols[0]
    for site, logits, divisor in _sites(ctx, samplers):
        if divisor is not None or id(site) in reported or not _policy_site(ctx, site, logits):
            continue
        if anywhere and not _beyond_reach(ctx, site, logits):
            continue
        reported.add(id(site))
        yield Violation(site, f"the trainer's log-probs use the policy's logits not divided by any temperature, "
                              f"but the sampler{_at(ctx, call)} samples at `{ctx.code(expr)}`, which is "
                              "not 1 unless configured so; divide the logits by the same temperature")


def _beyond_reach(ctx: Analysis, site: cst.CSTNode, logits: cst.BaseExpression | None) -> bool:
    """Whether the site scores logits of a model forward run in its own function, and no temperature the module
    applies can reach them (:func:`may_reach`): the module's other applications scale other logits."""
    func = ctx.enclosing_function(site)
    chain = logits if logits is not None else _site_logits(ctx, site)
    if func is None or chain is None:
        return False
    forward = model_call_of(ctx, chain)
    if forward is None or ctx.enclosing_function(forward) is not func:
        return False
    ref = model_role(ctx, chain)
    return not may_reach(ctx, func, ref.roots if ref is not None else None)


def _symbol(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    """A temperature that is configured rather than literal: a config field, attribute, key or parameter."""
    if isinstance(expr, cst.IfExp):  # ``cfg.temperature if not greedy else 0``
        return _symbol(ctx, expr.body) or _symbol(ctx, expr.orelse)
    if isinstance(expr, cst.Name):
        # a local bound to literals (``t = 0.7 if mode else 1.0``) has known values, one of which may be 1
        for d in ctx.flow.reaching(expr.value, expr):
            if d.kind in ("assign", "aug") and d.value is not None and _literal_choice(ctx, d.value):
                return False
    return isinstance(expr, (cst.Name, cst.Attribute, cst.Subscript)) and temperature_expr(expr)


def _literal_choice(ctx: Analysis, expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.IfExp):
        return _literal_choice(ctx, expr.body) or _literal_choice(ctx, expr.orelse)
    return _resolve(ctx, expr, 0) is not None


def _sibling(ctx: Analysis, samplers: set[int], reported: set[int]):
    """One trainer path divides the policy's logits by a temperature symbol; another path of the same class (or
    module) scores the same model's logits undivided in a function that applies no temperature at all."""
    scaled = list(_scaled_logits(ctx, samplers))
    if not scaled:
        return
    sites = list(_sites(ctx, samplers, no_grad=True))
    for site, logits, divisor in sites:
        if divisor is not None or id(site) in reported:
            continue
        func = ctx.enclosing_function(site)
        if func is None or applies_temperature(ctx, func) or not _policy_site(ctx, site, logits):
            continue
        cls = ctx.enclosing_class(site)
        ref = model_role(ctx, logits if logits is not None else _site_logits(ctx, site))
        partner = next((s for s, r, d in scaled if ctx.enclosing_class(s) is cls
                        and ctx.enclosing_function(s) is not func and ref is not None and r.roots & ref.roots), None)
        if partner is None:
            continue
        reported.add(id(site))
        divisor = next(d for s, r, d in scaled if s is partner)
        yield Violation(site, f"these log-probs use the policy's logits not divided by the temperature, but "
                              f"`{ctx.enclosing_function(partner).name.value}`{_at(ctx, partner)} divides "
                              f"the same model's logits by `{ctx.code(divisor)}`; the two log-probs are of "
                              "different distributions. Apply the same temperature here")


def _helper_sites(ctx: Analysis, func: cst.FunctionDef):
    """Log-prob sites inside ``func`` whose logits come from one of its parameters, undivided."""
    params = {p.name.value for p in func.params.params}
    for call in ctx.nodes(cst.Call):
        if ctx.enclosing_function(call) is not func:
            continue
        site = gather_site(ctx, call)
        if site is None or site.logits is None:
            continue
        expr, depth = site.logits, 8
        while depth > 0:
            depth -= 1
            if isinstance(expr, cst.Subscript):
                expr = expr.value
            elif isinstance(expr, cst.Call) and ctx.call_name(expr) in (
                    "torch.log_softmax", "torch.nn.functional.log_softmax") and expr.args:
                expr = expr.args[0].value
            elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in (
                    "log_softmax", "float", "to", "contiguous", "squeeze", "view", "reshape") \
                    and not ctx.is_module_function(expr):
                expr = expr.func.value
            elif isinstance(expr, cst.Name):
                defs = ctx.flow.reaching(expr.value, expr)
                if any(d.kind == "param" for d in defs) and expr.value in params:
                    yield call
                    break
                plain = [d for d in defs if d.kind == "assign" and d.value is not None]
                if len(plain) != 1 or len(defs) != 1:
                    break
                expr = plain[0].value
            else:
                break


def _misplaced(ctx: Analysis, samplers: set[int], reported: set[int]):
    """A caller passes a temperature into a log-prob helper's parameter that is not a temperature (positionally,
    into another slot): the helper never divides its logits, so the caller's temperature is silently dropped."""
    from rlguard.lint.analysis.values import bind_arguments

    for call in ctx.nodes(cst.Call):
        func = ctx.callee(call)
        if func is None or id(func) in samplers or applies_temperature(ctx, func, depth=0):
            continue
        for param, (value, _frame) in bind_arguments(func, call, None):
            if not _symbol(ctx, value) or TEMPERATURE_WORD.fullmatch(param) or _reads(ctx, func, param):
                continue
            for site in _helper_sites(ctx, func):
                if id(site) in reported:
                    continue
                reported.add(id(site))
                yield Violation(site, f"these log-probs use logits never divided by a temperature, and the caller"
                                      f"{_at(ctx, call)} passes `{ctx.code(value)}` into the parameter "
                                      f"`{param}`, which is not one: the sampling temperature is dropped. Add a "
                                      "temperature parameter and divide the logits by it")


def _reads(ctx: Analysis, func: cst.FunctionDef, name: str) -> bool:
    """Does ``func``'s body read ``name`` at all (a parameter it could apply in any way)?"""
    return any(n.value == name and ctx.contains(func.body, n) for n in ctx.index.descendants(func, cst.Name))


def _fallback_param(ctx: Analysis, expr: cst.BaseExpression) -> str | None:
    """``t or 1.0`` / ``t if t is not None else 1.0`` / ``t`` where ``t`` is a parameter (of this function or an
    enclosing one) whose default is None or 1: the parameter's name, when the value is 1 unless a caller passes
    it."""
    name = None
    if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.Or) and \
            _resolve(ctx, expr.right) == 1.0 and isinstance(expr.left, cst.Name):
        name = expr.left
    elif isinstance(expr, cst.IfExp) and isinstance(expr.body, cst.Name) and _resolve(ctx, expr.orelse) == 1.0:
        name = expr.body
    if name is None or not TEMPERATURE_WORD.fullmatch(name.value):
        return None
    defs = ctx.flow.reaching(name.value, name)
    if len(defs) != 1 or defs[0].kind != "param":
        return None
    default = defs[0].value
    if default is not None and not (isinstance(default, cst.Name) and default.value == "None") \
            and _resolve(ctx, default) != 1.0:
        return None
    return name.value


LOGP_COMPUTATION = re.compile(r"(?i)\w*log_?softmax\w*|\w*(log_?probs?|logps?)\w*|log_prob")
# what a temperature read that does not scale anything sits in: a guard, an assertion, a report
_REPORTING_CALL = re.compile(r"(?i)print|warn(ing)?|info|debug|error|exception|critical|log|format|add_scalars?")


def _unapplied_parameter(ctx: Analysis, reported: set[int]):
    """A function that takes a sampling temperature as a parameter (its interface says so) and computes
    log-probs, but never divides by it nor hands it on: every read of the parameter is a guard (``if temperature
    != 1.0:``), an assertion or a report. Its log-probs are at temperature 1 whatever its callers pass (the
    division dropped, or lost from the branch that kept the guard)."""
    for func in ctx.nodes(cst.FunctionDef):
        params = [p.name.value for p in (*func.params.posonly_params, *func.params.params, *func.params.kwonly_params)
                  if TEMPERATURE_WORD.fullmatch(p.name.value) and not p.name.value.endswith("s")]
        if not params:
            continue
        calls = ctx.index.descendants(func.body, cst.Call)
        if any(dotted_name(c.func) in ("locals", "vars") for c in calls):
            continue
        sites = [c for c in calls if _computes_logp(ctx, c)]
        if not sites:
            continue
        names = ctx.index.descendants(func.body, cst.Name)
        for param in params:
            reads = [n for n in names if n.value == param]
            if any(not _inert_read(ctx, n, func) for n in reads):
                site = _undivided_sibling(ctx, sites, param)
                if site is not None and id(site) not in reported:
                    reported.add(id(site))
                    yield Violation(site, f"these log-probs come from a model's logits not divided by `{param}`, "
                                          f"while another path of `{func.name.value}` divides its logits by it: "
                                          "one branch scores at temperature 1; divide these logits too")
                continue
            site = sites[0]
            if id(site) in reported:
                continue
            reported.add(id(site))
            yield Violation(site, f"`{func.name.value}` takes the sampling temperature `{param}` but never divides "
                                  "the logits by it, so these log-probs are at temperature 1 whatever the caller "
                                  f"passes; divide the logits by `{param}` before the log-softmax")
            break


def _undivided_sibling(ctx: Analysis, sites: list[cst.Call], param: str) -> cst.Call | None:
    """Of the log-prob sites of one function, one whose logits come from a model call undivided while another
    site's logits, also from a model call, are divided by the temperature parameter ``param``."""
    traced = []
    for site in sites:
        logits = _logits_of(ctx, site)
        if logits is None:
            continue
        reached, divisor = logits_divisor(ctx, logits, site)
        if reached:
            traced.append((site, divisor))
    divided = [site for site, d in traced if d is not None and dotted_name(d) == param]
    return next((site for site, d in traced
                 if d is None and any(ctx.index.in_other_branch(site, x) for x in divided)), None)


def _logits_of(ctx: Analysis, call: cst.Call) -> cst.BaseExpression | None:
    if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("log_softmax", "log_prob") and \
            not ctx.is_module_function(call) and not (ctx.call_name(call) or "").startswith("torch."):
        return call.func.value
    value = argument(call, 0, "logits")
    return value if value is not None else argument(call, None, "input")


def _computes_logp(ctx: Analysis, call: cst.Call) -> bool:
    name = ctx.call_name(call) or dotted_name(call.func) or ""
    last = name.rsplit(".", 1)[-1]
    if not last and isinstance(call.func, cst.Attribute):
        last = call.func.attr.value
    return bool(last) and not is_sampling_call(call) and (
        LOGP_COMPUTATION.fullmatch(last) is not None or name in CROSS_ENTROPY or name == "cross_entropy")


def _inert_read(ctx: Analysis, name: cst.Name, func: cst.FunctionDef) -> bool:
    """A read that scales nothing: part of a comparison or a truth test of an ``if``/``assert``/conditional, or
    an argument of a print/logging call or f-string."""
    node: cst.CSTNode = name
    parent = ctx.index.parent.get(id(node))
    if isinstance(parent, (cst.AssignTarget, cst.AnnAssign)) and parent.target is node:
        return True  # rebound (`if temperature is None: temperature = cfg.temperature`): not a read
    if isinstance(parent, cst.Attribute) and parent.attr is node or isinstance(parent, cst.Arg) and \
            parent.keyword is node or isinstance(parent, cst.Param):
        return True  # `cfg.temperature`, `f(temperature=...)`, a nested function's own parameter: other names
    while parent is not None and parent is not func:
        if isinstance(parent, (cst.Comparison, cst.Assert, cst.FormattedString)):
            return True
        if isinstance(parent, (cst.If, cst.While)) and node is parent.test:
            return True
        if isinstance(parent, cst.IfExp) and node is parent.test:
            return True
        if isinstance(parent, cst.BooleanOperation) or isinstance(parent, cst.UnaryOperation) and isinstance(
                parent.operator, cst.Not):
            node, parent = parent, ctx.index.parent.get(id(parent))
            continue
        if isinstance(parent, cst.Arg):
            owner = ctx.index.parent.get(id(parent))
            last = (dotted_name(owner.func) or "").rsplit(".", 1)[-1] if isinstance(owner, cst.Call) else ""
            return bool(_REPORTING_CALL.fullmatch(last) or re.fullmatch(r"[A-Z]\w*(Error|Exception|Warning)", last))
        return False
    return True


def _fallback(ctx: Analysis, reported: set[int]):
    """A method of a class that holds its sampling temperature (``self.temperature``, used for the training
    loss) computes log-probs at an optional temperature parameter that falls back to 1, and no call in the
    module passes it: the old log-probs are taken at temperature 1."""
    for call in ctx.nodes(cst.Call):
        if not LOGP_CALL.fullmatch(_callee_name(call) or "") or is_sampling_call(call):
            continue
        cls = ctx.enclosing_class(call)
        if cls is None:
            continue
        for arg in call.args:
            if arg.keyword is not None and not TEMPERATURE_WORD.fullmatch(arg.keyword.value):
                continue
            param = _fallback_param(ctx, arg.value)
            if param is None:
                continue
            attrs = _class_temperatures(ctx, cls)
            if not attrs or _passed_by_callers(ctx, param, call):
                continue
            reported.add(id(call))
            yield Violation(arg.value, f"these log-probs are taken at temperature 1 unless a caller passes "
                                       f"`{param}`, and no call in this module does, while the class trains at "
                                       f"`{attrs[0]}`; default to `{attrs[0]}`")


def _class_temperatures(ctx: Analysis, cls: cst.ClassDef) -> list[str]:
    """``self.<temperature>`` attributes of ``cls`` that are bound from a config and handed to a call as a
    temperature (``functools.partial(loss_fn, temperature=self.temperature)``)."""
    found = []
    for arg_owner in ctx.nodes(cst.Call):
        if ctx.enclosing_class(arg_owner) is not cls:
            continue
        for arg in arg_owner.args:
            key = dotted_name(arg.value) or ""
            if key.startswith("self.") and key.count(".") == 1 and TEMPERATURE_WORD.fullmatch(key[5:]) and (
                    arg.keyword is None or TEMPERATURE_WORD.fullmatch(arg.keyword.value)):
                defs = ctx.index.class_defs.get(id(cls), {}).get(key, [])
                if defs and all(d.value is not None and _resolve(ctx, d.value) is None for d in defs) \
                        and key not in found:
                    found.append(key)
    return found


def _passed_by_callers(ctx: Analysis, param: str, at: cst.CSTNode) -> bool:
    """Does any call in the module pass ``param`` by keyword, or call the enclosing method with as many
    positional arguments as reach it?"""
    func = ctx.enclosing_function(at)
    while func is not None and param not in {p.name.value for p in func.params.params}:
        func = ctx.enclosing_function(func)
    if func is None:
        return True
    names = [p.name.value for p in func.params.params]
    position = names.index(param) - (1 if names and names[0] in ("self", "cls") else 0)
    for call in ctx.nodes(cst.Call):
        if _callee_name(call) != func.name.value:
            continue
        if any(a.keyword is not None and a.keyword.value == param for a in call.args):
            return True
        positional = [a for a in call.args if a.keyword is None]
        if any(a.star == "*" for a in positional):
            continue  # forwarding ``*args`` from outside the module: unknown, counted as not passing
        if len(positional) > position:
            return True
    return False


def _undivided_against_sampler(ctx: Analysis, samplers: set[int], sampler_temps: list, reported: set[int]):
    """The old log-probs of a ratio are the sampler's own (the log-softmax of the scores a generation returned,
    which the sampler's temperature already shaped), the sampler is handed a temperature that is not visibly 1,
    and the log-probs they are compared with come from the policy's logits undivided: the ratio compares two
    distributions, not one before and after a step."""
    from rlguard.lint.analysis.provenance import FORWARD, ROLLOUT, provenance
    from rlguard.lint.analysis.roles import ratio_terms

    temps = [(call, expr) for call, expr, value in sampler_temps if value is None or value not in (0.0, 1.0)]
    terms = ratio_terms(ctx) if temps else []
    if not terms:
        return
    prov = provenance(ctx)
    sites = [site for site in gather_sites(ctx) if site.logits is not None and id(site.node) not in reported]
    for call, cur, old in terms:
        old_origins = prov.value(old)
        if not any(o.kind == ROLLOUT and o.what == "logprobs" and o.name == "scores" for o in old_origins) or \
                any(o.kind == FORWARD for o in old_origins):
            continue  # the old side is not the sampler's own log-probs (of the scores its temperature shaped)
        func = ctx.enclosing_function(call)
        for site in sites:
            if ctx.enclosing_function(site.node) is not func or id(site.node) in reported:
                continue
            forwards = [o for o in prov.value(site.logits) if o.kind in (FORWARD, ROLLOUT)]
            if not forwards or not all(o.kind == FORWARD and o.what in ("logits", "logprobs") and
                                       o.model is not None and o.model.role in ("policy", "model") for o in forwards):
                continue
            if logits_divisor(ctx, site.logits, site.node)[1] is not None or not _feeds(ctx, site.node, cur):
                continue
            reported.add(id(site.node))
            sampler, temperature = temps[0]
            yield Violation(site.node, f"these log-probs use the policy's logits not divided by the temperature, but "
                                       f"the old log-probs they are compared with in the ratio{_at(ctx, call)} are "
                                       f"the sampler's own, drawn at temperature `{ctx.code(temperature)}` (line "
                                       f"{_line(ctx, sampler)}): the ratio is not 1 before any step. Divide these "
                                       "logits by the same temperature")


def _feeds(ctx: Analysis, site: cst.Call, expr: cst.BaseExpression, depth: int = 4) -> bool:
    """Whether the value ``site`` computes reaches ``expr`` through plain assignments (``lp = f(...)``, then
    ``lp = torch.masked_fill(lp, m, x)``)."""
    home = ctx.index.statement_of(site)
    stack = [(expr, depth)]
    while stack:
        node, left = stack.pop()
        names = [node] if isinstance(node, cst.Name) else ctx.index.descendants(node, cst.Name)
        for name in names:
            for d in ctx.flow.reaching(name.value, name):
                if d.stmt is home:
                    return True
                if left > 0 and d.kind == "assign" and d.value is not None:
                    stack.append((d.value, left - 1))
    return False


def _ratio_partner(ctx: Analysis, logp_def_stmt: cst.CSTNode, key: str):
    """The ``old`` of ``exp(key - old)`` (directly or through a log-ratio variable) in the same function."""
    from rlguard.lint.analysis.roles import ratio_terms

    func = ctx.enclosing_function(logp_def_stmt)
    for call, cur, old in ratio_terms(ctx):
        if ctx.enclosing_function(call) is not func:
            continue
        while isinstance(cur, cst.Subscript):
            cur = cur.value
        if isinstance(cur, cst.Name) and cur.value == key:
            yield old


def _from_sampler(ctx: Analysis, expr: cst.BaseExpression, depth: int = 8) -> cst.Call | None:
    """The sampling call whose result ``expr`` reads (``out.per_token_logps.to(dev)[idx]`` with
    ``out = engine.rollout(...)``), or None."""
    while depth > 0 and expr is not None:
        depth -= 1
        if isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call):
            if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in ("to", "float", "detach", "cuda",
                                                                                   "clone", "contiguous"):
                expr = expr.func.value
            elif SAMPLER_CALL.fullmatch(_callee_name(expr) or "") and not _is_eval(ctx, expr):
                return expr
            else:
                return None
        elif isinstance(expr, cst.Attribute):
            expr = expr.value
        elif isinstance(expr, cst.Name):
            defs = ctx.flow.reaching(expr.value, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None:
                return None
            expr = defs[0].value
        else:
            return None
    return None


def _autocast(ctx: Analysis, samplers: set[int], reported: set[int]):
    """The trainer's forward runs under ``torch.autocast`` but its log-softmax is taken after the block, on the
    half-precision logits (autocast would have run it in float32), while the old log-probs it is compared with
    come from the sampler: the ratio is not 1 before any step."""
    if not any("autocast" in ctx.code(item.item).lower() for w in ctx.nodes(cst.With) for item in w.items):
        return  # no autocast block in the module
    for site in ctx.nodes(cst.Call):
        func = ctx.enclosing_function(site)
        if id(site) in reported or func is not None and (id(func) in samplers or EVAL_NAME.fullmatch(func.name.value)):
            continue
        found = gather_site(ctx, site)
        logits = found.logits if found is not None else None
        if logits is None or grad_context(ctx).enabled(site) is False:
            continue
        if logits is None or autocast_region(ctx, site) is not None or upcast(ctx, logits):
            continue
        softmax = ctx.code(logits)
        if "log_softmax" not in softmax and "log_softmax" not in ctx.code(site):
            continue
        model_call = model_call_of(ctx, logits)
        if model_call is None or autocast_region(ctx, model_call) is None:
            continue
        stmt = ctx.index.statement_of(site)
        targets = [d for d in ctx.index.stmt_defs.get(id(stmt), ()) if d.kind == "assign" and "." not in d.key]
        if len(targets) != 1:
            continue
        sampler = next((c for old in _ratio_partner(ctx, stmt, targets[0].key)
                        for c in [_from_sampler(ctx, old)] if c is not None), None)
        if sampler is None:
            continue
        reported.add(id(site))
        yield Violation(site, f"the forward ran under autocast but this log-softmax is taken after the block, on "
                              f"half-precision logits, while the old log-probs it is compared with come from the "
                              f"sampler {_at(ctx, sampler)}, computed in float32: the ratio is not 1 "
                              "before any step. Take the log-softmax inside the autocast block or upcast the "
                              "logits with `.float()`")


# Library facts (versioned): inference-engine configurations whose returned log-probs are, by default, taken
# before the sampler's temperature and top-p (``raw``), and the option that asks for the processed ones.
# megatron-core >= 0.15 ``InferenceConfig(logprobs_mode=...)``; vLLM >= 0.10.2 (V1 engine) ``LLM(...,
# logprobs_mode=...)`` / ``EngineArgs`` / ``AsyncEngineArgs``, default ``"raw_logprobs"``.
RAW_LOGPROB_ENGINES = {
    "megatron.core.inference.config.InferenceConfig": "logprobs_mode",
    "vllm.LLM": "logprobs_mode",
    "vllm.EngineArgs": "logprobs_mode",
    "vllm.AsyncEngineArgs": "logprobs_mode",
    "vllm.engine.arg_utils.EngineArgs": "logprobs_mode",
    "vllm.engine.arg_utils.AsyncEngineArgs": "logprobs_mode",
}
PROCESSED = re.compile(r"processed_(logprobs|logits)")


def _engine_logprobs_mode(ctx: Analysis):
    """An inference engine configured in this module without asking for processed log-probs, while the module
    samples at a temperature that is not provably 1 and reads the engine's log-probs."""
    engines = []
    for call in ctx.nodes(cst.Call):
        name = ctx.call_name(call) or ""
        option = RAW_LOGPROB_ENGINES.get(name)
        if option is None:
            continue
        if any(a.star for a in call.args):
            continue  # options splatted from a dict: unknown
        value = argument(call, None, option)
        if value is not None and not (isinstance(value, cst.SimpleString) and not PROCESSED.search(value.value)):
            continue
        engines.append(call)
    if not engines:
        return
    temperature = None
    for call in ctx.nodes(cst.Call):
        if not is_sampling_call(call) or _is_eval(ctx, call):
            continue
        value = argument(call, None, "temperature")
        if value is None:
            continue
        if isinstance(value, cst.IfExp):
            value = value.body
        resolved = _resolve(ctx, value)
        if resolved is not None and resolved in (0.0, 1.0):
            continue
        if resolved is None and not _symbol(ctx, value):
            continue
        if not _reads_logprobs(ctx, call):
            continue
        temperature = (call, value)
        break
    if temperature is None:
        return
    call, value = temperature
    for engine in engines:
        yield Violation(engine, f"this inference engine returns raw log-probs (before temperature and top-p) "
                                f"unless asked for processed ones, and the module samples at "
                                f"`{ctx.code(value)}`{_at(ctx, call)} and reads the engine's log-probs: "
                                "they are not the distribution the trainer scores. Pass "
                                "`logprobs_mode=\"processed_logprobs\"`")


def _reads_logprobs(ctx: Analysis, sampling: cst.Call) -> bool:
    """The sampling call asks for log-probs (``return_log_probs=True``, ``logprobs=k``)."""
    for kw in ("return_log_probs", "return_logprobs", "output_logprobs"):
        if literal_bool(argument(sampling, None, kw)) is True:
            return True
    value = argument(sampling, None, "logprobs")
    return value is not None and not (isinstance(value, cst.Name) and value.value in ("None", "False"))


def _at(ctx: Analysis, node: cst.CSTNode) -> str:
    line = _line(ctx, node)
    return f" (line {line})" if line != "?" else ""


def _logp_divided(ctx: Analysis):
    """``token_logp / T`` (or ``/= T``): a temperature applied to gathered log-probs instead of to the logits
    before the softmax; the result is not a log-distribution of any temperature."""
    for node in ctx.nodes(cst.BinaryOperation, cst.AugAssign):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Divide):
            left, divisor = node.left, node.right
        elif isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.DivideAssign):
            left, divisor = node.target, node.value
        else:
            continue
        if not temperature_expr(divisor) or _resolve(ctx, divisor) == 1.0:
            continue
        if isinstance(left, cst.Name) and isinstance(node, cst.AugAssign):
            defs = [d for d in ctx.flow.reaching(left.value, node) if d.stmt is not node]
            ok = len(defs) == 1 and defs[0].kind == "assign" and defs[0].value is not None \
                and gathered_logp(ctx, defs[0].value)
        else:
            ok = gathered_logp(ctx, left)
        if ok:
            yield Violation(node, f"the temperature `{ctx.code(divisor)}` divides log-probs already gathered from a "
                                  "log-softmax; that is not the log-prob of any temperature. Divide the logits "
                                  "before the log-softmax")


def _isinstance_guard(test: cst.BaseExpression) -> tuple[str, frozenset] | None:
    """``isinstance(v, A)`` / ``isinstance(v, (A, B))``: (``v``, {``A``, ``B``})."""
    if not (isinstance(test, cst.Call) and isinstance(test.func, cst.Name) and test.func.value == "isinstance"
            and len(test.args) == 2 and isinstance(test.args[0].value, cst.Name)):
        return None
    kinds = test.args[1].value
    elements = [e.value for e in kinds.elements] if isinstance(kinds, cst.Tuple) else [kinds]
    if not all(isinstance(e, cst.Name) for e in elements):
        return None
    return test.args[0].value.value, frozenset(e.value for e in elements)


def _guard_of(ctx: Analysis, node: cst.CSTNode) -> tuple[str, frozenset] | None:
    """The isinstance test of the innermost ``if`` / ``elif`` branch ``node`` sits in (not its ``else``)."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return None
        if isinstance(anc, cst.If) and ctx.contains(anc.body, node):
            return _isinstance_guard(anc.test)
    return None


def _class_method(ctx: Analysis, name: str, method: str) -> cst.FunctionDef | None:
    cls = ctx.class_named(name)
    return ctx.method_of(cls, method) if cls is not None else None


def _scores_logprobs(ctx: Analysis, func: cst.FunctionDef) -> bool:
    """``func`` gathers token log-probs from a log-softmax, or hands its logits to a log-prob helper."""
    if any(ctx.enclosing_function(site.node) is func and site.kind == "gather" and site.logits is not None
           for site in _gather_sites(ctx)):
        return True
    for call in ctx.nodes(cst.Call):
        if ctx.enclosing_function(call) is func and LOGP_CALL.fullmatch(_callee_name(call) or "") and call.args:
            first = call.args[0].value
            while isinstance(first, cst.Call) and isinstance(first.func, cst.Attribute):
                first = first.func.value  # logits.to(torch.float32)
            if isinstance(first, cst.Name) and first.value == "logits":
                return True
    return False


def _gather_sites(ctx: Analysis):
    from rlguard.lint.analysis.alignment import gather_sites

    return gather_sites(ctx)


def _hands_logits_to_loss(ctx: Analysis, func: cst.FunctionDef) -> bool:
    """``func`` passes its ``logits`` parameter to a callable held by the object (``self.loss_fn``) and returns
    what it computes: a loss over the logits."""
    params = [p.name.value for p in func.params.params]
    if "logits" not in params:
        return False
    for call in ctx.nodes(cst.Call):
        if ctx.enclosing_function(call) is not func or not call.args:
            continue
        first = call.args[0].value
        if not (isinstance(first, cst.Name) and first.value == "logits"):
            continue
        callee = dotted_name(call.func) or ""
        held = callee.startswith("self.") or any(
            d.kind == "assign" and d.value is not None and (dotted_name(d.value) or "").startswith("self.")
            for d in ctx.flow.reaching(callee, call)) if callee else False
        if held and "loss" in callee.lower() and ctx.callee(call) is None:
            return True
    return False


def _guarded_scaling(ctx: Analysis, reported: set[int]):
    """Logits are scaled by the temperature only under ``isinstance(fn, (A, B))``, for consumers that compute
    log-probs, while a consumer of another type in a sibling branch computes the training loss from the same
    logits: the loss and the old log-probs are of different temperatures."""
    for stmt in ctx.nodes(cst.Assign, cst.Expr):
        value = stmt.value
        if not isinstance(value, cst.Call):
            continue
        helper = ctx.callee(value)
        if helper is None or not applies_temperature(ctx, helper, depth=1) or not value.args:
            continue
        scaled = value.args[0].value
        if not isinstance(scaled, cst.Name):
            continue
        guard = _guard_of(ctx, stmt)
        if guard is None:
            continue
        var, kinds = guard
        if not any(_scores_logprobs(ctx, m) for k in kinds for m in [_class_method(ctx, k, "__call__")] if m):
            continue
        func = ctx.enclosing_function(stmt)
        for call in ctx.nodes(cst.Call):
            if ctx.enclosing_function(call) is not func or id(call) in reported:
                continue
            if not (isinstance(call.func, cst.Name) and call.func.value == var):
                continue
            if not any(isinstance(a.value, cst.Name) and a.value.value == scaled.value for a in call.args):
                continue
            other = _guard_of(ctx, call)
            if other is None or other[0] != var or other[1] & kinds:
                continue
            if not any(_hands_logits_to_loss(ctx, m) for k in other[1]
                       for m in [_class_method(ctx, k, "__call__")] if m):
                continue
            reported.add(id(call))
            yield Violation(call, f"the logits are divided by the temperature only for "
                                  f"{', '.join(sorted(kinds))} (log-probs), but this "
                                  f"{', '.join(sorted(other[1]))} computes the training loss from the same logits "
                                  "unscaled: the loss and the old log-probs are of different temperatures; "
                                  "scale the logits for the loss too")

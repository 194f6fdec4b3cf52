"""Documentation bodies for the catalog codes that have no lint rule (a lint rule's docs are its docstring).

:func:`rlguard.lint.docs.render_page` wraps each body with the title, the catalog summary, the runtime
counterpart and a note on suppression. Kept free of torch and libcst: only text.
"""

from rlguard.catalog import (
    ADVANTAGE_SIGN, DETACHED_TARGETS, GRAD_NOT_ZEROED, PADDING_LEAK, RELOAD_MISMATCH, ROWS_OUT_OF_STEP,
    STOP_TOKEN_UNTRAINED, TENSOR_CONTRACT, TRAIN_MODE_SCORING, TRAINED_PARAMS_DRIFT,
)

PAGES: dict[str, str] = {
    TENSOR_CONTRACT: """
        ## What it is
        No static check: caught at run time by the runtime contracts (`@contract`, see
        [docs/contracts.md](../contracts.md)). RLG000 is the catch-all code for a tensor whose shape or dtype
        does not match its annotation when no more specific code applies: a `[B, T]` tensor where `[B, T-1]` is
        declared, float token ids, a loss that is not a scalar, NaN or Inf in a `Finite()` tensor. The message
        names the function and the argument, the expected dims with the sizes bound so far (`B=8, T=256`) and
        what arrived.

        ## Why it matters
        Broadcasting hides shape bugs: a `[B]` advantage multiplied with `[B, T-1]` log-probs and a `[B, 1]`
        one give different losses with no error, and a `[B, T]` mask times `[B, T-1]` log-probs fails only after
        someone "fixes" it by slicing the wrong end. Training runs, the loss is finite, and the model learns
        from the wrong tokens.

        ## Example
        ```python
        @contract
        def policy_loss(logp: LogProbs, mask: ActionMask) -> Loss:   # both [B, T-1]
            ...

        policy_loss(logp, batch["attention_mask"])   # [B, T]: RLG000 names `mask`, expected [B, T-1], B=8, T=256
        ```

        ## Use instead
        Pass tensors aligned to `ids[:, 1:]` (every per-token training tensor is `[B, T-1]`), or fix the
        annotation if the function really takes another layout.

        ## Fix
        No automatic fix, and no lint rule: a shape is a run-time fact. Read the violation's message: it says
        which argument, which dimension and which binding disagree.

        ## Options
        `RLGUARD=off|warn|raise` in the environment (or `rlguard.contracts.set_mode`) chooses whether a
        violation raises, warns or is skipped; `@contract(check_every=N)` checks one call in N.
    """,
    TRAINED_PARAMS_DRIFT: """
        ## What it is
        No static check: caught at run time by the runtime contracts' `Guard` on every optimizer step (see
        [docs/contracts.md](../contracts.md)), and before the run by the preflight suite (`rlguard check`, see
        [docs/preflight.md](../preflight.md)), which performs one real update on a copy of your model and
        compares every parameter and buffer before and after. Parameters outside the intended trainable set
        (a frozen backbone or embedding, the reference model, a reward or value normaliser) must be
        bit-identical after the step.

        ## Why it matters
        Which weights train is decided far from the loss: `requires_grad` flags, which modules go into the
        optimizer, `model.parameters()` versus a filtered list, a PEFT wrapper. A frozen part that trains
        anyway rarely crashes; it drifts. The reference model that moves with the policy makes the KL
        penalty vanish; an unfrozen embedding under a small-LR adapter recipe slowly degrades every prompt.
        The symptom is quality that wanders for no visible reason, or a KL to the reference that stays near
        zero.

        ## Example
        ```python
        model.pos_emb.requires_grad_(False)                      # meant to stay frozen...
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)     # ...harmless while it gets no gradient, but
        model.requires_grad_(True)                               # a later "unfreeze everything" trains it
        ```

        ## Use instead
        ```python
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        ```

        ## Fix
        No automatic fix, and no lint rule: which parameters are meant to train is a decision the code does not
        state in one place. The Guard's and the preflight report's messages list the parameters that changed
        and should not have.

        ## Options
        `Guard(..., frozen=...)` names the frozen set (names, prefixes or a predicate; default: the
        parameters with `requires_grad=False` when the Guard is built); the preflight adapter declares the
        intended trainable set with `trainable_names` (see [docs/preflight.md](../preflight.md)).
    """,
    RELOAD_MISMATCH: """
        ## What it is
        No static check: caught at run time by the preflight suite (`rlguard check`, see
        [docs/preflight.md](../preflight.md)), which saves a checkpoint, reloads it into a fresh model and
        compares the outputs on the same inputs.

        ## Why it matters
        A checkpoint that does not reproduce the policy fails silently at the worst moment: evaluation or a
        resumed run uses a different model from the one that was trained. Common causes are state kept outside
        `state_dict()` (an observation or reward normaliser, a temperature), a dtype change on save (bf16 to fp16,
        fp32 master weights dropped), keys renamed by a wrapper (`module.`, `_orig_mod.` after `torch.compile`)
        loaded with `strict=False`, or a PEFT adapter saved without its base.

        ## Example
        ```python
        torch.save(model.state_dict(), "ckpt.pt")
        fresh.load_state_dict(torch.load("ckpt.pt"), strict=False)   # silently skips the renamed keys
        ```

        ## Use instead
        ```python
        missing, unexpected = fresh.load_state_dict(torch.load("ckpt.pt"), strict=True)
        # and save every piece of state the policy needs (normalisers, generation settings) with it
        ```

        ## Fix
        No automatic fix, and no lint rule: whether a checkpoint is complete depends on run-time state. The
        preflight report says which outputs differ and by how much.

        ## Options
        The preflight adapter supplies the save and load functions to test (see [docs/preflight.md](../preflight.md)).
    """,
    "RLG900": """
        ## What it flags
        A file that rlguard could not read or parse: a syntax error (reported at its line and column), a file
        that is not UTF-8, a null byte, or a file the OS would not let rlguard read. No rule ran on that file,
        so it may hide any other finding.

        ## Why it is reported
        A linter that skipped unparsable files quietly would report "all checks passed" on exactly the files it
        never looked at. RLG900 makes the gap visible and makes `rlguard lint` exit 1. It is rlguard's own code,
        not a failure mode of a trainer.

        ## Example
        ```python
        def loss(logp, old_logp:
            return -(logp - old_logp).mean()
        ```
        reports `RLG900 [syntax-error] syntax error: ...` at the position of the error.

        ## Use instead
        Fix the syntax error, or save the file as UTF-8. Files that are broken on purpose (test fixtures)
        belong in `exclude` in `[tool.rlguard]`.

        ## Fix
        No automatic fix.

        ## Options
        `exclude` skips files and folders; `ignore = ["RLG900"]` or `per-file-ignores` drops the finding.
        `target-version` (or `--target-version py312`) says which Python the code is for, and so which syntax
        is valid; it defaults to the lowest version `requires-python` allows in the nearest `pyproject.toml`,
        and without one to the newest grammar rlguard knows. The verdict does not depend on the interpreter
        that runs rlguard: a 3.12 file linted on Python 3.11 with `target-version = "py312"` parses.
    """,
    "RLG901": """
        ## What it flags
        A `# noqa` comment that names an rlguard code which silences nothing on its line: the rule ran on the
        file and found nothing there, the code is checked at run time only (RLG014, RLG015...), or there is no
        such code. Off unless selected: `--extend-select RLG901` (or `select` with `RLG901`, `RLG9` or `ALL`).

        ## Why it is reported
        A stale `# noqa: RLG004` stays after the bug it silenced is fixed, and silences the next real RLG004
        on that line without anyone noticing. Listing the codes that no longer silence anything keeps the
        comments honest. It is rlguard's own code, not a failure mode of a trainer.

        ## Example
        ```python
        loss = pg_loss - ent_coef * entropy.mean()  # noqa: RLG004
        ```
        reports `RLG901 [unused-noqa] unused noqa: RLG004 (no RLG004 finding on this line); remove it`.

        ## Use instead
        ```python
        loss = pg_loss - ent_coef * entropy.mean()
        ```

        ## Fix
        No automatic fix: delete the code from the comment (or the comment).

        ## Options
        Only codes of rlguard (`RLG...`) are judged: `# noqa: E501` for another tool and a bare `# noqa` are
        left alone, and so are codes of rules that did not run on the file (not selected, `per-file-ignores`),
        since another configuration may need them.

        ## Suppression
        Add `RLG901` to the comment (`# noqa: RLG004, RLG901`) to keep a code on purpose.
    """,
    "RLG902": """
        ## What it flags
        A file on which rlguard itself failed: a rule raised (its findings on that file are missing), or the
        shared analysis did (no rule's findings on that file are reported). The message names the rule and the
        exception; `--verbose` or `RLGUARD_DEBUG=1` prints the traceback. The other rules' findings on the
        file, and every other file, are still reported, and `rlguard lint` exits 2.

        ## Why it is reported
        A linter that fails on a file and says "All checks passed" has checked less than it claims. RLG902
        puts the failure in every output format (text, json, sarif, github) at the file's path, so CI and code
        scanning see that the file was not fully checked. It is rlguard's own code, not a failure mode of a
        trainer: it is a bug or a limit of rlguard, so please report it with the file (or a small part of it).

        ## Example
        ```python
        # a file on which rule RLG004 raises, because of a bug in the rule
        loss = pg_loss + kl_coef * kl
        ```
        reports `RLG902 [internal-error] rlguard failed on this file (rule RLG004 raised ...); the findings of
        RLG004 on this file are missing`, beside the file's other findings.

        ## Use instead
        ```python
        # nothing to change in your code: report the error; exclude the file meanwhile if it blocks CI
        ```

        ## Fix
        No automatic fix.

        ## Options
        None: RLG902 is always reported, whatever the selection. `exclude` skips a file that rlguard cannot
        check while the bug is fixed.

        ## Suppression
        Cannot be silenced by `# noqa` or `ignore`: it means the file was not fully checked. Exclude the file
        (`exclude` in `[tool.rlguard]`) to stop checking it at all.
    """,
}


# More about each code's runtime counterpart than the catalog's one line: appended to the page's
# "Runtime counterpart" section by rlguard.lint.docs.render_page.
RUNTIME: dict[str, str] = {
    GRAD_NOT_ZEROED: """
        The contracts' `Guard` checks it at every `optimizer.step()` it hooks
        (`Guard(policy=model, optimizer=opt)`, one optimizer or a list): after each step it records the
        identity and version counter of a few parameters' `.grad` (no gradient is written, and values are read
        only when a gradient looks untouched), and at the first backward that reaches them afterwards sees
        whether they were zeroed or set to `None`. A stale
        gradient is reported before the next step runs, so that step never applies it; gradient accumulation
        over the microbatches of one step is not affected. See [docs/contracts.md](../contracts.md), "The
        guard".
    """,
    TRAINED_PARAMS_DRIFT: """
        The contracts' `Guard(..., frozen=...)` checks it at every `optimizer.step()` it hooks: at
        construction, frozen parameters that are in an optimizer's param groups and require grad; before
        each step, frozen parameters holding a gradient in the stepping optimizer's groups (reported before
        the step changes them, also for fused optimizers); after each step, the frozen set's version
        counters; and on the Guard's `check_every` cadence a float64 norm per frozen tensor, against the
        previous one (writes that bypass version counters: `.data`, fused kernels). See
        [docs/contracts.md](../contracts.md), "The guard".
    """,
    DETACHED_TARGETS: """
        In the contracts: `NoGrad()` on old/reference log-probs, advantages and returns. In the preflight:
        `targets_detached` calls the adapter's `old_log_probs`, `sampler_log_probs`, `advantages` (and
        `ref_log_probs` / `returns` where it has them) with autograd on, as the trainer's own code runs, and
        fails when one carries a graph (`requires_grad` or a `grad_fn`).
    """,
    ADVANTAGE_SIGN: """
        During training the contracts see a sign that flips mid-run: `FollowsRewards(rewards=...)` on group
        advantages (a higher reward never has a lower advantage within a group; every value-check call) and
        `UpdateDirection(advantages=...)` on the current log-probs in the loss (under a `Guard`: the rows seen
        before and after an optimizer step in one update must move with their advantages; verdict at the end of
        each update). The preflight's `advantage_direction` correlates one real update's change of log pi with
        the suite's own group-centred rewards.
    """,
    PADDING_LEAK: """
        `@row_independent(ids=..., mask=..., pad_id=...)` on a scoring function re-scores one row of every 16th
        call (the last row first, then each in turn) alone and with 8 more columns of padding on the side the
        batch is padded on (read from the mask; both sides for left-padded prompts before right-padded
        completions), under `no_grad`, random generators forked, the result dropped: the row's values must not
        move beyond a dtype-aware tolerance (float32: mean 1e-4 / max 1e-2; half precision 0.05 / 1.0). `ids`
        and `mask` may be paths into a dict, dataclass or object batch (`"batch.input_ids"`). Cost: two forwards
        of one row on one call in 16, 1.8% of a scoring call on the benchmark model (three forwards, 2.5%, for a
        batch padded on both sides; [docs/benchmarks.md](../benchmarks.md)). The preflight's `padding_leak` scores the batch
        in reverse order, its last row alone and with 8 more pad columns (0.02 s on the reference trainer).
    """,
    STOP_TOKEN_UNTRAINED: """
        `StopTokenInMask(ids=..., stop_ids=...)` on the loss mask: each completion's first stop token (any of
        the stop ids: EOS and whatever else generation stops on) is in the mask, whatever the pad token is (0.27
        ms per call on a 8 x 256 batch). The preflight's `stop_token_trained` does the same with the policy's
        ground truth and the adapter's `stop_token_ids`, drawing more batches (up to 8) until some completion has
        a stop token, and says "not exercised" when none does.
    """,
    TRAIN_MODE_SCORING: """
        The `Guard` puts a forward pre-hook on the reference (every forward) and on the policy (forwards with
        autograd off: sampling, old log-probs) that finds every dropout module (and every float
        `attention_dropout`-style rate) inactive, naming the one that is not: flags only, about 0.1 ms per
        forward. `EvalMode()` does the same on a scoring function's model argument. The preflight's
        `scoring_eval_mode` runs two scoring passes of the old policy and of the reference under different
        random seeds, which must agree exactly (0.02 s on the reference trainer).
    """,
    ROWS_OUT_OF_STEP: """
        `RowsInStep(key="ids")` on the fields of an episode, at the producer and at the loss, keeps each row's
        exact hash from the batch's making to the end of the update that uses it (under a `Guard`; 0.25 ms per
        checked call for two [8, 255] fields); `@permutation_invariant(group_size=...)` on a loss re-computes it
        on a consistent permutation of the rows (groups kept together, never the identity) every 16th call: one
        more call of the loss with autograd off, 1.2x a loss call over a batch of 8 x 256 on the benchmark model,
        7.5% per call at `every=16` ([docs/benchmarks.md](../benchmarks.md)); relative tolerance 1e-4 in float32,
        2e-2 in half precision. The preflight's
        `rows_in_step` permutes rows for the loss, the batch (`select_rows`) and pairs of rows for the trainer's
        own `backward` (0.09 s on the reference trainer), within the same dtype-aware relative tolerance.
    """,
}

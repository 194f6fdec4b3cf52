"""Integrations of rlguard with RL training frameworks; each lives in its own subpackage and needs its own extra.

``rlguard.integrations.trl``: Hugging Face TRL's ``GRPOTrainer`` (``pip install 'rlguard[trl]'``).
``rlguard.integrations.verl``: verl's policy losses, advantage estimators and ``DataProto`` batches (``pip install
'rlguard[verl]'``). Nothing here is imported by ``rlguard lint`` or by the core.
"""

"""The engine's bookkeeping, in pure Python (no torch): sequences, the scheduler, block accounting, the
handoff backlog, the priority gate, detokenization and speculation's proposals."""

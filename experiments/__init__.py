"""The paper's experiments and their reports: users of fedsaddle, not part of the coordinator."""

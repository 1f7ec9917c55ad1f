"""What one train step is made of: the train state and its shardings (`state`), the loss
(`loss`), the optimizer and its schedule (`optim`), the step itself (`step`), skipped bad steps
(`bad_steps`) and optimizer state offloaded to host memory (`offload`)."""

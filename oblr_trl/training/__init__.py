"""OBLR-PO wired into TRL: `OBLRPOTrainer`, `OBLRPOConfig`, the collaborators the trainer hands each concern to, and
the hooks they place on the optimizer and the model. Uses `oblr_trl.estimators`; never the command line's modules
above it (`docs/architecture.md`)."""

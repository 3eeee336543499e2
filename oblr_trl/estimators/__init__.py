"""The math of OBLR-PO: pure, typed functions of tensors (baselines, weights, per-sample gradient norms, SNR, the trust
region's rule, gradient sketches). torch only: nothing here imports TRL, transformers or the rest of the package
(`docs/math.md`)."""

"""L2 features (msprobe's `l2_targets` / `recording_l2_features`): per attention cell the statistics of
its Q.K logits, per linear cell its weight's spectral norm and stable rank. Configured in the tensor
statistics' config.json and attached by its hooks (mindmon.features.tensor_stats)."""

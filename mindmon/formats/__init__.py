"""Every on-disk and on-log format mindmon writes, one module each, holding both directions (the
writer the sinks use and the reader the offline tools use), so a format cannot drift:

- `layout`: the run directory (`rank_<r>/` folders) and the global micro-step;
- `jsonl`: `rank_<r>/metrics.jsonl`, one record per line;
- `columnar`: `rank_<r>/metrics.parquet` and the Arrow stream it is compacted from;
- `log_lines`: the training-log lines (train_state, tokens per expert, max attention logit) and
  MindFormers' own LossCallback line, which mindmon only reads;
- `megatron_tpe`: `tokens_per_expert/rank<r>.jsonl` in Megatron-Core's schema;
- `histogram`: the counts of a histogram record (Adam's update and ratio, 30 bins over [-1, 1]);
- `msprobe_csv`: msprobe's `<prefix>_<start>-<end>.csv` tensor-statistics files.
"""

"""The embedded demo: a tiny MindFormers-shaped MoE GPT, synthetic data, and a launch script."""

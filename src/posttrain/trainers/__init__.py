"""Trainers: SFT, reward model, DPO, online RL."""

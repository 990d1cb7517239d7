"""Reinforcement learning for language models, written on plain torch: :mod:`llmpipe.rl.ppo` holds the PPO
algorithm pieces (advantages, KL estimators, clipped losses, reward normalisation) as pure functions that the
`ppo` stage composes and the unit tests pin against hand-computed values."""

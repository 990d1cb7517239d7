"""Reinforcement learning for language models: the reward functions PPO and GRPO score completions with
(:mod:`.rewards`), the prompts both select (:mod:`.prompts`), the first-vs-last-10% reward figures both report
(:mod:`.progress`), and PPO on plain torch + Accelerate (:mod:`.ppo`)."""

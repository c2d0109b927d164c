"""RL: the controller loop, data, rewards and losses."""

"""The method, with no data and no loop: the tree batch (`tree.py`), branch replay itself
(`replay.py`), the one engine over trees, its one entry and its naive twin (`engine.py`), the
objectives (`losses.py`: a new objective is one `losses.register`), the advantage estimators
(`advantages.py`: one `advantages.register`), the critic, the shared-prefix sampler, the
trie of rollouts and the sharding rules (`sharding.py`: one `RULES` table). Imports only
`models/` and itself."""

"""The pure order math behind :class:`~tokenfeed.plan.Plan` and :class:`~tokenfeed.mixture.Mixture`.

Every function here is a pure function of its arguments (no I/O, no global RNG, no
platform-dependent integers), numpy only, so a server and a trainer compute the same order
on any machine. One job per module:

- :mod:`~tokenfeed.order.ints`: int64/uint64 limits and argument checks;
- :mod:`~tokenfeed.order.splitmix`: the splitmix64 mixer every key is derived with;
- :mod:`~tokenfeed.order.feistel`: the keyed permutation of ``[0, n)`` (:func:`permute`);
- :mod:`~tokenfeed.order.sized`: many such permutations in one call (per-row size, key);
- :mod:`~tokenfeed.order.blocks`: the block shuffle's layout of regions and blocks;
- :mod:`~tokenfeed.order.steps`: global steps, resume positions and DataLoader workers;
- :mod:`~tokenfeed.order.schedule`: a mixture schedule, validated and reduced to integers;
- :mod:`~tokenfeed.order.swrr`: one period of smooth weighted round robin;
- :mod:`~tokenfeed.order.locate`: a mixture's stream position to ``(source, position)``.

Nothing here imports the submodules eagerly: ``import tokenfeed.order`` costs nothing.
"""

"""Data sources: ``build_data(cfg.data, seq_len, seed)`` returns a :class:`DataSource`.

- ``synthetic``: a sparse random Markov source with a known entropy rate (no download).
- ``text``: local files (data.train, data.valid or data.valid_fraction).
- ``tinyshakespeare``, ``wikitext2``, ``wikitext103``: data.path=DIR, else the Hugging Face Hub.

Text sources share one byte-level BPE trained on the train split, cached under data.cache_dir.
"""

from __future__ import annotations

from adapipe_cli.data.source import Batch, DataError, DataSource
from adapipe_cli.data.synthetic import MarkovSource
from adapipe_cli.data.text import TEXT_SOURCES

SOURCES = ("synthetic", *TEXT_SOURCES)

__all__ = ["SOURCES", "Batch", "DataError", "DataSource", "MarkovSource", "build_data"]


def build_data(cfg, seq_len: int, seed: int) -> DataSource:
    """The source ``cfg.name`` names (cfg: a DataConfig or its OmegaConf node), yielding sequences
    of seq_len tokens; ``seed`` picks the train samples, never the validation set."""
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}: sequences need at least 1 token (model.block_size)")
    if cfg.name == "synthetic":
        return MarkovSource(
            vocab_size=cfg.vocab_size,
            order=cfg.order,
            branching=cfg.branching,
            concentration=cfg.concentration,
            source_seed=cfg.source_seed,
            seq_len=seq_len,
            seed=seed,
            eval_tokens=cfg.eval_tokens,
        )
    if cfg.name in TEXT_SOURCES:
        from adapipe_cli.data.corpus import build_text_source  # imports tokenizers

        return build_text_source(cfg, seq_len, seed)
    raise DataError(f"data={cfg.name!r} is not a data source; choose one of {', '.join(SOURCES)}")

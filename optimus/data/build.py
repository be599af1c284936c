"""Assemble the training mixture, loader and held-out sets that a config asks for."""

from __future__ import annotations

from dataclasses import dataclass

from optimus.config import Config
from optimus.data.dataset import TokenDataset, has_heldout_split, open_token_dataset
from optimus.data.errors import DataError
from optimus.data.loader import BatchLoader
from optimus.data.mixture import Mixture
from optimus.data.npy import TokenFiles
from optimus.data.recipe import recipe_sources
from optimus.data.sources import check_tokenizer_fits, tokenizer_info
from optimus.data.tokenize import prepare_packaged


@dataclass
class TrainingData:
    loader: BatchLoader
    heldout: list[TokenDataset]


def build_training_data(config: Config, dp_rank: int = 0, dp_size: int = 1) -> TrainingData:
    """Tokenize packaged corpora if needed (cached), open every source, blend them, and shard by DP rank.

    OLMo .npy globs (directly or through data.recipe) have no held-out split: they train only.
    """
    check_tokenizer_fits(config.data.tokenizer, config.model.vocab_size)
    sources = recipe_sources(config.data) if config.data.recipe is not None else config.data.sources
    tokenizer = tokenizer_info(config.data.tokenizer) if any(s.glob is not None for s in sources) else {}
    train_sets, heldout_sets, weights = [], [], []
    for source in sources:
        if source.glob is not None:
            eos_id = tokenizer["eos_id"] if source.eos_id is None else source.eos_id
            train_sets.append(TokenFiles(source.glob, tokenizer["vocab_size"], eos_id, source.dtype))
        elif source.name is not None:
            train_path, heldout_path = prepare_packaged(
                source.name, config.data.tokenizer, config.data.cache_dir, config.data.heldout_fraction
            )
            train_sets.append(open_token_dataset(train_path, tokenizer=config.data.tokenizer))
            heldout_sets.append(open_token_dataset(heldout_path, tokenizer=config.data.tokenizer))
        else:
            train_sets.append(open_token_dataset(source.path, split="train", tokenizer=config.data.tokenizer))
            # a folder without a held-out split simply does not take part in evaluation; one whose split is
            # there but unreadable is an error (skipping it would silently drop every eval_loss)
            if has_heldout_split(source.path):
                heldout_sets.append(open_token_dataset(source.path, split="heldout", tokenizer=config.data.tokenizer))
        weights.append(source.weight)
    for dataset in train_sets:
        if dataset.num_instances(config.train.seq_len) == 0:
            raise DataError(f"data source {dataset.path} holds fewer than seq_len+1 tokens: add text or lower train.seq_len")
    mixture = Mixture(train_sets, weights, config.train.seq_len, config.train.seed)
    # the trainer passes a config whose micro-batch validate_layout filled in; other callers (eval) get each
    # rank's share in one micro-batch, the derived default without pipeline parallelism
    micro = config.train.micro_batch_size or max(1, config.train.global_batch_size // dp_size)
    loader = BatchLoader(mixture, config.train.global_batch_size, micro, dp_rank, dp_size,
                         vocab_size=config.model.vocab_size)
    return TrainingData(loader=loader, heldout=heldout_sets)

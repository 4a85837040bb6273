"""Datasets (built from conf/data/*.yaml through `_target_`), samplers and loaders.

Every dataset function returns `(train, test)`, or `(train, val, test)` where the source has a
validation split of its own; otherwise `data.val_fraction` of the training set becomes the
validation split, chosen by `trainer.seed` (the same on every rank and every launcher).

Training shards with DistributedSampler (padded so every rank runs the same number of steps,
unless `data.even_shards=false`). Evaluation splits into fixed chunks of `eval_batch_size`
consecutive samples, dealt to the ranks in turn: every sample counts once, and a chunk is computed
alike at any world size, so the metrics are bit-equal whether 1, 2 or 3 ranks evaluate
(evaluation.py sums the chunks in order).

A shard directory (shards.py: data=shards) is read in windows of shards, never whole: its training
order is index arithmetic over the manifest (sampling.ShardWindowOrder), so the same resume, the
same evaluation chunks and the same world-size rules hold for it.
"""

# The package's API: the sources' builders are what conf/data/*.yaml names (hydra_ddp.data.digits).
from hydra_ddp.data.about import about  # noqa: F401
from hydra_ddp.data.about import line as about_line  # noqa: F401
from hydra_ddp.data.loading import (  # noqa: F401
    EvalSplit,
    Loaders,
    TensorBatches,
    build_datasets,
    build_loaders,
    carve,
    eval_split,
    loader_options,
    save_with_run,
    stream_refusal,
)
from hydra_ddp.data.sampling import (  # noqa: F401
    ResumableDistributedSampler,
    SeededSamples,
    ShardWindowOrder,
    ShardWindowSampler,
    sample_seed,
)
from hydra_ddp.data.shards import ShardedDataset, sharded  # noqa: F401
from hydra_ddp.data.source_checks import check_source, text_shape  # noqa: F401
from hydra_ddp.data.sources import (  # noqa: F401
    CIFAR10_FILES,
    SPLITS,
    ImageArrays,
    cifar10,
    diabetes,
    digits,
    image_folder,
    mnist,
    python_source,
    python_source_dicts,
    shapes,
    split_folders,
    synthetic,
    synthetic_regression,
)
from hydra_ddp.data.text import PadCollate, TokenDocuments, documents  # noqa: F401

//! Model stages: a contiguous range of a layered model's blocks, with or without the input
//! embedding and the output head.
//!
//! A stage is a model of its own ([`Module`]) that allocates only its part of the parameters.
//! Its blocks keep their **global** indices in their names (`h.2`, `h.3` for blocks 2 and 3 of a
//! GPT, `bert.encoder.layer.2` for layer 2 of a BERT, whatever stage holds them), so a stage's state dict uses exactly the names of the full
//! model's and a checkpoint can be split or joined by name. Dropout masks are keyed by module path
//! and the [`ForwardCtx`], so a stage run in the context the full
//! model runs in draws the same masks.
//!
//! * [`StageSpec`] says which part a stage holds; [`StageSpec::check_partition`] checks that a
//!   list of stages covers every block once, in order.
//! * [`BlockRange`] holds a stage's blocks under their global indices.
//! * [`ModelStage`] is what every staged model provides: its spec, the parameters tied between
//!   its first and last stage, and one forward that maps a microbatch and the previous stage's
//!   hidden states to hidden states, or to the loss on the stage with the head. Three models
//!   implement it: [`Gpt`](crate::gpt::Gpt) (one type for the whole model and its stages, the
//!   whole model being [`StageSpec::full`]; blocks `h.{i}`, microbatch
//!   [`GptBatch`](crate::gpt::GptBatch), the tied `wte.weight`),
//!   [`BertForMaskedLM`](crate::bert::BertForMaskedLM) (one type for the whole model and its
//!   stages, the whole model being [`StageSpec::full`]; encoder layers `bert.encoder.layer.{i}`,
//!   microbatch [`BertBatch`](crate::bert::BertBatch) with the attention mask every stage reads,
//!   the tied `bert.embeddings.word_embeddings.weight`; its "embedding" is `bert.embeddings`, its
//!   "head" the MLM head `cls`) and [`Llama`](crate::llama::Llama) (one type for the whole model and
//!   its stages, the whole model being [`StageSpec::full`]; layers `model.layers.{i}`,
//!   microbatch [`LlamaBatch`](crate::llama::LlamaBatch), the tied `model.embed_tokens.weight`
//!   when the embeddings are tied).
//!
//! Chaining the stages — feeding each stage's output, as a new leaf, to the next, and its
//! gradient back with [`Var::backward_with`] — computes the full model's loss and gradients
//! bit for bit, once the gradients of the tied parameters ([`ModelStage::tied_parameters`]) are
//! summed between the stages that hold a copy.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::{ForwardCtx, Var};
use meshgrad_tensor::Result;

use crate::module::{Child, Module, ModuleField};

/// Which part of a model a stage holds: a contiguous, non-empty range of blocks by global index,
/// and whether it also holds the input embedding (it then reads token ids and must start at
/// block 0) and the output head (final norm, head and loss; it must end at the last block).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StageSpec {
    /// Global indices of the stage's blocks.
    pub blocks: Range<usize>,
    /// Holds the input embedding (the first stage).
    pub embedding: bool,
    /// Holds the final norm and the output head (the last stage).
    pub head: bool,
}

impl StageSpec {
    /// A stage of blocks `blocks`, with or without the embedding and the head.
    pub fn new(blocks: Range<usize>, embedding: bool, head: bool) -> Self {
        StageSpec {
            blocks,
            embedding,
            head,
        }
    }

    /// The whole model of `n_layer` blocks as one stage.
    pub fn full(n_layer: usize) -> Self {
        StageSpec::new(0..n_layer, true, true)
    }

    /// Consecutive stages of `sizes[i]` blocks each (the first with the embedding, the last with
    /// the head), checked against `n_layer` with [`StageSpec::check_partition`].
    pub fn split(n_layer: usize, sizes: &[usize]) -> Result<Vec<StageSpec>> {
        let mut start = 0;
        let specs: Vec<StageSpec> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let s = StageSpec::new(start..start + n, i == 0, i + 1 == sizes.len());
                start += n;
                s
            })
            .collect();
        StageSpec::check_partition(&specs, n_layer)?;
        Ok(specs)
    }

    /// `stages` stages of as equal a number of blocks as `n_layer` allows (the earlier stages
    /// get one more when it does not divide).
    pub fn even(n_layer: usize, stages: usize) -> Result<Vec<StageSpec>> {
        if stages == 0 || stages > n_layer {
            meshgrad_tensor::bail!(
                "stages: {stages} stages of {n_layer} blocks (need 1..={n_layer} stages, each \
                 with at least one block)"
            );
        }
        let sizes: Vec<usize> = (0..stages)
            .map(|i| n_layer / stages + usize::from(i < n_layer % stages))
            .collect();
        StageSpec::split(n_layer, &sizes)
    }

    /// Checks this stage against a model of `n_layer` blocks, with a one-line error: the range is
    /// non-empty and inside `0..n_layer`, a stage with the embedding starts at block 0 and a
    /// stage with the head ends at block `n_layer`.
    pub fn validate(&self, n_layer: usize) -> Result<()> {
        let r = &self.blocks;
        if r.start >= r.end {
            meshgrad_tensor::bail!(
                "stage spec: block range {}..{} is empty (a stage holds at least one block)",
                r.start,
                r.end
            );
        }
        if r.end > n_layer {
            meshgrad_tensor::bail!(
                "stage spec: block range {}..{} goes past the model's {n_layer} blocks \
                 (n_layer = {n_layer})",
                r.start,
                r.end
            );
        }
        if self.embedding && r.start != 0 {
            meshgrad_tensor::bail!(
                "stage spec: a stage with the embedding must start at block 0, not {}",
                r.start
            );
        }
        if self.head && r.end != n_layer {
            meshgrad_tensor::bail!(
                "stage spec: a stage with the head must end at the last block ({n_layer}), not \
                 at {}",
                r.end
            );
        }
        Ok(())
    }

    /// Checks that `stages`, in order, split a model of `n_layer` blocks: each is valid, they
    /// neither overlap nor leave a gap, the first holds the embedding and the last the head (and
    /// no other stage does). One-line errors naming the stage.
    pub fn check_partition(stages: &[StageSpec], n_layer: usize) -> Result<()> {
        if stages.is_empty() {
            meshgrad_tensor::bail!("stages: no stage given for a model of {n_layer} blocks");
        }
        let mut next = 0;
        for (i, s) in stages.iter().enumerate() {
            s.validate(n_layer)
                .map_err(|e| meshgrad_tensor::Error::msg(format!("stage {i}: {e}")))?;
            let r = &s.blocks;
            if r.start < next {
                meshgrad_tensor::bail!(
                    "stages: stage {i} (blocks {}..{}) overlaps the stages before it, which hold \
                     blocks up to {next}",
                    r.start,
                    r.end
                );
            }
            if r.start > next {
                meshgrad_tensor::bail!(
                    "stages: blocks {next}..{} are held by no stage (stage {i} starts at {})",
                    r.start,
                    r.start
                );
            }
            next = r.end;
            if s.embedding != (i == 0) {
                meshgrad_tensor::bail!(
                    "stages: {} (stage {i} of {})",
                    if i == 0 {
                        "the first stage must hold the embedding"
                    } else {
                        "only the first stage may hold the embedding"
                    },
                    stages.len()
                );
            }
            if s.head != (i + 1 == stages.len()) {
                meshgrad_tensor::bail!(
                    "stages: {} (stage {i} of {})",
                    if i + 1 == stages.len() {
                        "the last stage must hold the head"
                    } else {
                        "only the last stage may hold the head"
                    },
                    stages.len()
                );
            }
        }
        if next != n_layer {
            meshgrad_tensor::bail!("stages: blocks {next}..{n_layer} are held by no stage");
        }
        Ok(())
    }
}

impl std::fmt::Display for StageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "blocks {}..{}", self.blocks.start, self.blocks.end)?;
        if self.embedding {
            write!(f, " + embedding")?;
        }
        if self.head {
            write!(f, " + head")?;
        }
        Ok(())
    }
}

/// A stage's blocks under their global indices: as a field named `h` holding blocks 2..4 it
/// names them `h.2` and `h.3` (a `Vec` field would name them `h.0` and `h.1`), so parameter
/// names, module paths (hence dropout masks) and tensor-parallel plans are the full model's.
pub struct BlockRange<B> {
    start: usize,
    blocks: Vec<Arc<B>>,
}

impl<B> BlockRange<B> {
    /// Blocks `start`, `start + 1`, ... (global indices).
    pub fn new(start: usize, blocks: Vec<Arc<B>>) -> Self {
        BlockRange { start, blocks }
    }

    /// The global indices of the blocks.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.blocks.len()
    }

    /// The blocks in order (the first is block [`BlockRange::range`]`().start`).
    pub fn blocks(&self) -> &[Arc<B>] {
        &self.blocks
    }

    /// The blocks in order, mutably (to adjust freshly built blocks, e.g. a checkpoint's
    /// activation function).
    pub fn blocks_mut(&mut self) -> &mut [Arc<B>] {
        &mut self.blocks
    }

    /// The block of global index `index`, if this range holds it.
    pub fn get(&self, index: usize) -> Option<&Arc<B>> {
        index
            .checked_sub(self.start)
            .and_then(|i| self.blocks.get(i))
    }

    /// `(global index, block)` in order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Arc<B>)> {
        self.blocks
            .iter()
            .enumerate()
            .map(move |(i, b)| (self.start + i, b))
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// `range[i]` is the block of **global** index `i` (for a whole model, simply block `i`).
///
/// Panics when this range does not hold block `i` (see [`BlockRange::get`]).
impl<B> std::ops::Index<usize> for BlockRange<B> {
    type Output = Arc<B>;

    fn index(&self, index: usize) -> &Arc<B> {
        let r = self.range();
        self.get(index).unwrap_or_else(|| {
            panic!(
                "block {index} is not in this stage's blocks {}..{}",
                r.start, r.end
            )
        })
    }
}

impl<B: Module> ModuleField for BlockRange<B> {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        for (i, b) in self.iter() {
            f(&format!("{name}.{i}"), Child::Module(&**b));
        }
    }
}

/// What a stage's forward starts from.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids `[B, T]` (the stage with the embedding).
    Ids(&'a meshgrad_tensor::Tensor),
    /// The previous stage's hidden states `[B, T, C]` (every later stage).
    Hidden(&'a Var),
}

/// A stage of a layered model (see the [module docs](self)).
///
/// `Batch` is what every stage reads of a microbatch besides the previous stage's hidden
/// states: the first stage reads the inputs (token ids), the stage with the head the targets,
/// models with masks read them in every stage (BERT's attention mask).
pub trait ModelStage: Module {
    /// A microbatch as the stages read it.
    type Batch;

    /// The part of the model this stage holds.
    fn spec(&self) -> &StageSpec;

    /// Names of the parameters that the first and the last stage each hold a copy of (a tied
    /// embedding and head). Both copies start equal; the gradient of the tied parameter is the
    /// sum of the copies' gradients, and both copies must take the same update. Empty when the
    /// model ties nothing, and always held once by a single stage that is the whole model.
    ///
    /// Provided: the [`ModelStage::tied_table`] when this stage holds the embedding or the head
    /// but not both.
    fn tied_parameters(&self) -> Vec<String> {
        let spec = self.spec();
        match self.tied_table() {
            Some(name) if spec.embedding != spec.head => vec![name.to_string()],
            _ => Vec::new(),
        }
    }

    /// The name of the table the embedding and the head share (GPT's `wte.weight`), if the model
    /// ties one.
    fn tied_table(&self) -> Option<&'static str>;

    /// Runs the stage on `batch`: the stage with the embedding reads the inputs from `batch`
    /// (`hidden` is `None`), a later stage reads `hidden`, the previous stage's output. Returns
    /// the hidden states for the next stage, or the mean loss on the stage with the head.
    fn forward_stage(&self, batch: &Self::Batch, hidden: Option<&Var>) -> Result<Var>;
}

/// Runs `stages` (a partition of one model, in order) one after the other on one device, the way
/// a pipeline runs one microbatch: each stage's forward in `ctx` (the full model's context, so
/// dropout draws its masks), its output handed to the next stage as a fresh leaf; then the
/// backward of the loss and of every boundary gradient, last stage first. Returns the loss.
/// The copies of a tied table each get their own gradient; their sum is the full model's.
pub fn run_chained<S: ModelStage>(stages: &[S], batch: &S::Batch, ctx: ForwardCtx) -> Result<Var> {
    if stages.is_empty() {
        meshgrad_tensor::bail!("run_chained: no stages");
    }
    let mut inputs: Vec<Option<Var>> = vec![None];
    let mut outputs: Vec<Var> = Vec::with_capacity(stages.len());
    for (i, st) in stages.iter().enumerate() {
        let out = ctx.scope(|| st.forward_stage(batch, inputs[i].as_ref()))?;
        inputs.push(Some(Var::leaf(out.tensor().clone())));
        outputs.push(out);
    }
    let loss = outputs[stages.len() - 1].clone();
    loss.backward()?;
    for i in (0..stages.len() - 1).rev() {
        let Some(g) = inputs[i + 1].as_ref().and_then(|v| v.grad()) else {
            meshgrad_tensor::bail!("run_chained: stage {} got no gradient for its input", i + 1);
        };
        outputs[i].backward_with(g)?;
    }
    Ok(loss)
}

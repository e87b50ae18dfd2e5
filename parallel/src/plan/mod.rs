//! Predicting what a layout costs before a run: [`memory`] gives the bytes per rank a training
//! or inference run needs from the model's shape ([`meshgrad_nn::ModelShape`]) and the layout
//! alone (`meshgrad train`'s preflight check refuses a run with it); [`flops`] the operations of a
//! training step, counted as the Megatron-LM paper counts them.

pub mod flops;
pub mod memory;

//! Predicting what a layout costs before a run: [`memory`] gives the bytes per rank a training
//! or inference run needs from the model's shape ([`meshgrad_nn::ModelShape`]) and the layout
//! alone (`meshgrad train`'s preflight check refuses a run with it); [`flops`] the operations of a
//! training step, counted as the Megatron-LM paper counts them; [`device`] the device kinds
//! (TOML presets and user files); [`comm`] the alpha-beta cost of collectives per topology
//! level; [`cost`] the time of one training step of one candidate layout; [`search`] every
//! valid layout for a number of devices, ranked.

pub mod bubble;
pub mod calibrate;
pub mod comm;
pub mod compute;
pub mod cost;
pub mod device;
pub mod flops;
pub mod hf;
pub mod memory;
pub mod report;
pub mod search;

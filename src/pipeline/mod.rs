//! What happens to samples between raw storage and the batch. Once, before the tiers:
//! `preprocess` (image files decoded by `decode` and resized by `planes`). At every batch:
//! `augment` (each stream's pipeline: the center, or a seeded random crop and flip).

pub mod augment;
pub mod decode;
mod exif;
pub mod planes;
mod preprocess;
mod region;

pub use augment::{Crop, Cut, Pipeline, Spatial};
pub use preprocess::{prepare, FieldOp, Parse, Preprocess, Resize};

//! The field model: a sample is a list of named, typed fields. One description (dtype, shape with
//! fixed or variable dims, spatial pairing) serves the config, the sources, the scratch and
//! memory tiers (one record encoding), batch assembly, `ListDatasets` and the Python client,
//! which reads dtypes by their numpy names.
//!
//! ## A sample's record
//! The tiers keep a sample as one byte string:
//!
//! ```text
//! [u32 LE: each variable dim of each field, in field order] ++ field 0 bytes ++ field 1 bytes ...
//! ```
//!
//! Field bytes are the stored values, row-major, in the machine's byte order (HDF5 converts
//! big-endian files to it; nothing else is converted). A sample of fixed-shape fields has no
//! header at all: it is its fields' bytes back to back.
//!
//! ## Spatially paired fields (the contract the augmentation builds on)
//! A field is *spatial* when it has at least two dims; its last two are (H, W). A field declared
//! `pair = { with = "X", scale = s }` belongs to X's group: for every sample its H and W are s
//! times X's. Geometric transforms (resize, crop, flip) pick their parameters once per sample in
//! X's coordinates and apply them to every field of the group, the box scaled by s, each field
//! resampled its own way: `nearest` for masks and other integer ids (never blended), `linear`
//! for images. Fields outside any group are never transformed.

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

/// Element types a field may hold, by their numpy names. bool is stored as uint8 (0 or 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Uint8,
    Int8,
    Uint16,
    Int16,
    Uint32,
    Int32,
    Uint64,
    Int64,
    Float16,
    Float32,
    Float64,
}

impl DType {
    pub const ALL: [DType; 11] = [
        DType::Uint8,
        DType::Int8,
        DType::Uint16,
        DType::Int16,
        DType::Uint32,
        DType::Int32,
        DType::Uint64,
        DType::Int64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
    ];

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            DType::Uint8 | DType::Int8 => 1,
            DType::Uint16 | DType::Int16 | DType::Float16 => 2,
            DType::Uint32 | DType::Int32 | DType::Float32 => 4,
            DType::Uint64 | DType::Int64 | DType::Float64 => 8,
        }
    }

    /// The numpy name, as the proto and the Python client carry it.
    pub fn name(self) -> &'static str {
        match self {
            DType::Uint8 => "uint8",
            DType::Int8 => "int8",
            DType::Uint16 => "uint16",
            DType::Int16 => "int16",
            DType::Uint32 => "uint32",
            DType::Int32 => "int32",
            DType::Uint64 => "uint64",
            DType::Int64 => "int64",
            DType::Float16 => "float16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::Float16 | DType::Float32 | DType::Float64)
    }
}

/// How a spatial field is resampled when the pipeline resizes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Resample {
    /// Each output pixel is one input pixel: masks and class ids stay what they were.
    Nearest,
    /// Bilinear (or area, when shrinking): images. Also `"bilinear"`, torchvision's and
    /// timm's name.
    #[serde(alias = "bilinear")]
    Linear,
    /// Bicubic (Catmull-Rom, as PIL's BICUBIC), antialiased when shrinking: timm's and
    /// torchvision's `interpolation="bicubic"`.
    #[serde(alias = "bicubic")]
    Cubic,
}

impl Resample {
    pub fn name(self) -> &'static str {
        match self {
            Resample::Nearest => "nearest",
            Resample::Linear => "linear",
            Resample::Cubic => "cubic",
        }
    }
}

/// This field's place in a spatial group: its H and W are `scale` times those of field `with`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pairing {
    pub with: String,
    pub scale: u32,
}

/// One field of a dataset's samples.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldSpec {
    pub name: String,
    pub dtype: DType,
    /// Dims of one sample's value (a scalar has none); None is a dim that varies by sample.
    pub shape: Vec<Option<u32>>,
    pub pair: Option<Pairing>,
    pub resample: Resample,
}

impl FieldSpec {
    pub fn new(name: &str, dtype: DType, shape: Vec<Option<u32>>) -> FieldSpec {
        let resample = if dtype.is_float() || dtype == DType::Uint8 {
            Resample::Linear
        } else {
            Resample::Nearest
        };
        FieldSpec {
            name: name.to_string(),
            dtype,
            shape,
            pair: None,
            resample,
        }
    }

    /// Fixed dims only.
    pub fn fixed(name: &str, dtype: DType, shape: &[u32]) -> FieldSpec {
        FieldSpec::new(name, dtype, shape.iter().map(|&d| Some(d)).collect())
    }

    pub fn variable_dims(&self) -> usize {
        self.shape.iter().filter(|d| d.is_none()).count()
    }

    pub fn is_fixed(&self) -> bool {
        self.variable_dims() == 0
    }

    pub fn is_spatial(&self) -> bool {
        self.shape.len() >= 2
    }

    /// Bytes of one value when the shape is fixed (u64::MAX when that overflows: a file can
    /// claim any shape, and every limit refuses that size).
    pub fn fixed_bytes(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size() as u64, |acc, d| {
                d.map(|d| acc.saturating_mul(d as u64))
            })
    }

    /// The shape as the proto carries it: -1 for a variable dim.
    pub fn shape_i64(&self) -> Vec<i64> {
        self.shape
            .iter()
            .map(|d| d.map_or(-1, |d| d as i64))
            .collect()
    }

    /// e.g. `image uint8 [3, H, W]`.
    pub fn describe(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .map(|d| d.map_or("*".to_string(), |d| d.to_string()))
            .collect();
        format!("{} {} [{}]", self.name, self.dtype.name(), dims.join(", "))
    }

    /// Checks a value's dims against this field's shape.
    pub fn check_dims(&self, dims: &[u32]) -> Result<()> {
        ensure!(
            dims.len() == self.shape.len()
                && dims
                    .iter()
                    .zip(&self.shape)
                    .all(|(&d, s)| s.is_none_or(|s| s == d)),
            "field {:?} has shape {dims:?}, expected {}",
            self.name,
            self.describe()
        );
        Ok(())
    }
}

/// One value per raw field: a sample as its source reads it, before preprocessing.
pub type RawSample = Vec<Value>;

/// Bytes of a raw sample's fields, as read.
pub fn raw_bytes(raw: &RawSample) -> u64 {
    raw.iter().map(|v| v.data.len() as u64).sum()
}

/// Bytes of a value of `dims` with items of `item` bytes; usize::MAX when that overflows
/// (dims can come from a file: no length matches it, and no buffer is made for it).
pub fn bytes_of(item: usize, dims: &[u32]) -> usize {
    dims.iter().fold(item, |a, &d| a.saturating_mul(d as usize))
}

/// One field's value for one sample: its dims and its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    pub dims: Vec<u32>,
    pub data: Vec<u8>,
}

impl Value {
    pub fn new(dims: Vec<u32>, data: Vec<u8>) -> Value {
        Value { dims, data }
    }

    /// A scalar int64.
    pub fn int64(v: i64) -> Value {
        Value::new(vec![], v.to_ne_bytes().to_vec())
    }
}

/// A field of one decoded record: its dims and a view of its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldView<'a> {
    pub dims: Vec<u32>,
    pub data: &'a [u8],
}

/// The fields of a dataset's samples, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Schema {
    pub fields: Vec<FieldSpec>,
    /// Bytes of a record when every field is fixed.
    fixed_record: Option<u64>,
    /// Where each field's bytes lie in a record, when every field is fixed.
    fixed_ranges: Option<Vec<std::ops::Range<usize>>>,
}

impl Schema {
    pub fn new(fields: Vec<FieldSpec>) -> Result<Schema> {
        ensure!(!fields.is_empty(), "a dataset needs at least one field");
        for (i, f) in fields.iter().enumerate() {
            ensure!(!f.name.is_empty(), "a field has an empty name");
            if fields[..i].iter().any(|g| g.name == f.name) {
                bail!("field {:?} is declared twice", f.name);
            }
        }
        for f in &fields {
            let Some(p) = &f.pair else { continue };
            let with = fields.iter().find(|g| g.name == p.with).with_context(|| {
                format!(
                    "field {:?} pairs with {:?}, which is not a field of this dataset",
                    f.name, p.with
                )
            })?;
            ensure!(
                with.pair.is_none(),
                "field {:?} pairs with {:?}, which is itself paired: pair every field of a group with the same one",
                f.name,
                p.with
            );
            ensure!(
                p.scale >= 1,
                "field {:?}: pair scale must be at least 1",
                f.name
            );
            ensure!(
                f.is_spatial() && with.is_spatial(),
                "fields {:?} and {:?} are paired but not both spatial (at least 2 dims, the last two H and W): {} and {}",
                f.name,
                with.name,
                f.describe(),
                with.describe()
            );
            for k in 1..=2 {
                let (a, b) = (f.shape[f.shape.len() - k], with.shape[with.shape.len() - k]);
                if let (Some(a), Some(b)) = (a, b) {
                    ensure!(
                        a == b * p.scale,
                        "field {:?} pairs with {:?} at scale {} but their fixed sizes disagree: {} and {}",
                        f.name,
                        with.name,
                        p.scale,
                        f.describe(),
                        with.describe()
                    );
                }
            }
        }
        let fixed_record = fields.iter().try_fold(0u64, |acc, f| {
            f.fixed_bytes().map(|b| acc.saturating_add(b))
        });
        let fixed_ranges = fixed_record.map(|_| {
            let mut at = 0;
            fields
                .iter()
                .map(|f| {
                    let n = f.fixed_bytes().unwrap_or(0) as usize;
                    at = usize::saturating_add(at, n);
                    at - n..at
                })
                .collect()
        });
        Ok(Schema {
            fields,
            fixed_record,
            fixed_ranges,
        })
    }

    pub fn field(&self, name: &str) -> Option<(usize, &FieldSpec)> {
        self.fields.iter().enumerate().find(|(_, f)| f.name == name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.fields.iter().map(|f| f.name.as_str()).collect()
    }

    /// Bytes of every record, when all fields are fixed.
    pub fn fixed_record_bytes(&self) -> Option<u64> {
        self.fixed_record
    }

    /// Where each field's bytes lie in every record, when all fields are fixed.
    pub fn fixed_ranges(&self) -> Option<&[std::ops::Range<usize>]> {
        self.fixed_ranges.as_deref()
    }

    /// Identifies the schema (for the scratch tier's fingerprint).
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .fields
            .iter()
            .map(|f| match &f.pair {
                Some(p) => format!(
                    "{} pair {}x{} {}",
                    f.describe(),
                    p.with,
                    p.scale,
                    f.resample.name()
                ),
                None => f.describe(),
            })
            .collect();
        parts.join("; ")
    }

    /// Packs one sample's values (one per field, in order) into its record, checking each
    /// against its field.
    pub fn encode(&self, values: &[Value]) -> Result<Vec<u8>> {
        ensure!(
            values.len() == self.fields.len(),
            "{} values for {} fields",
            values.len(),
            self.fields.len()
        );
        let mut header = 0;
        let mut body = 0;
        for (f, v) in self.fields.iter().zip(values) {
            f.check_dims(&v.dims)?;
            let expected = bytes_of(f.dtype.size(), &v.dims);
            ensure!(
                v.data.len() == expected,
                "field {:?}: {} bytes for shape {:?} of {} (expected {expected})",
                f.name,
                v.data.len(),
                v.dims,
                f.dtype.name()
            );
            header += 4 * f.variable_dims();
            body += v.data.len();
        }
        let mut out = Vec::with_capacity(header + body);
        crate::alloc::prefault(&mut out);
        for (f, v) in self.fields.iter().zip(values) {
            for (d, s) in v.dims.iter().zip(&f.shape) {
                if s.is_none() {
                    out.extend_from_slice(&d.to_le_bytes());
                }
            }
        }
        for v in values {
            out.extend_from_slice(&v.data);
        }
        Ok(out)
    }

    /// Splits a record into its fields; an error if it does not fit the schema.
    pub fn decode<'a>(&self, record: &'a [u8]) -> Result<Vec<FieldView<'a>>> {
        let mut views = Vec::with_capacity(self.fields.len());
        let mut header = 0usize;
        let mut dims_all = Vec::with_capacity(self.fields.len());
        for f in &self.fields {
            let mut dims = Vec::with_capacity(f.shape.len());
            for s in &f.shape {
                dims.push(match s {
                    Some(d) => *d,
                    None => {
                        let raw = record
                            .get(header..header.saturating_add(4))
                            .context("record too short for its header")?;
                        header += 4;
                        u32::from_le_bytes(raw.try_into().unwrap())
                    }
                });
            }
            dims_all.push(dims);
        }
        let mut at = header;
        for (f, dims) in self.fields.iter().zip(dims_all) {
            let n = bytes_of(f.dtype.size(), &dims);
            let data = at
                .checked_add(n)
                .and_then(|end| record.get(at..end))
                .with_context(|| format!("record too short for field {:?}", f.name))?;
            at += n;
            views.push(FieldView { dims, data });
        }
        ensure!(
            at == record.len(),
            "record has {} bytes, its fields take {at}",
            record.len()
        );
        Ok(views)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn audio_schema() -> Schema {
        Schema::new(vec![
            FieldSpec::fixed("image", DType::Uint8, &[3, 4, 4]),
            FieldSpec::new("clip", DType::Int16, vec![None]),
            FieldSpec::new("boxes", DType::Float32, vec![None, Some(4)]),
            FieldSpec::fixed("label", DType::Int64, &[]),
        ])
        .unwrap()
    }

    #[test]
    fn records_round_trip_with_variable_dims() {
        let s = audio_schema();
        assert_eq!(s.fixed_record_bytes(), None);
        let values = vec![
            Value::new(vec![3, 4, 4], (0..48).collect()),
            Value::new(vec![5], vec![9; 10]),
            Value::new(vec![2, 4], vec![1; 32]),
            Value::int64(-7),
        ];
        let rec = s.encode(&values).unwrap();
        assert_eq!(
            rec.len(),
            8 + 48 + 10 + 32 + 8,
            "two variable dims in the header"
        );
        let views = s.decode(&rec).unwrap();
        for (v, w) in values.iter().zip(&views) {
            assert_eq!((&v.dims, &v.data[..]), (&w.dims, w.data));
        }
        assert!(s.decode(&rec[..rec.len() - 1]).is_err());
        let mut longer = rec.clone();
        longer.push(0);
        assert!(s.decode(&longer).is_err());
    }

    #[test]
    fn fixed_records_are_their_bytes_back_to_back() {
        let s = Schema::new(vec![
            FieldSpec::fixed("image", DType::Uint8, &[2, 2]),
            FieldSpec::fixed("label", DType::Int64, &[]),
        ])
        .unwrap();
        assert_eq!(s.fixed_record_bytes(), Some(12));
        assert_eq!(s.fixed_ranges().unwrap(), &[0..4, 4..12]);
        let rec = s
            .encode(&[Value::new(vec![2, 2], vec![1, 2, 3, 4]), Value::int64(3)])
            .unwrap();
        assert_eq!(&rec[..4], &[1, 2, 3, 4]);
        assert_eq!(&rec[4..], &3i64.to_ne_bytes());
    }

    #[test]
    fn values_that_do_not_fit_are_errors() {
        let s = audio_schema();
        let bad_shape = vec![
            Value::new(vec![3, 4, 5], vec![0; 60]),
            Value::new(vec![1], vec![0; 2]),
            Value::new(vec![0, 4], vec![]),
            Value::int64(1),
        ];
        let err = format!("{:#}", s.encode(&bad_shape).unwrap_err());
        assert!(err.contains("\"image\" has shape [3, 4, 5]"), "{err}");
        let bad_bytes = vec![
            Value::new(vec![3, 4, 4], vec![0; 48]),
            Value::new(vec![2], vec![0; 2]),
            Value::new(vec![0, 4], vec![]),
            Value::int64(1),
        ];
        let err = format!("{:#}", s.encode(&bad_bytes).unwrap_err());
        assert!(err.contains("\"clip\": 2 bytes"), "{err}");
    }

    #[test]
    fn pairing_is_checked() {
        let lr = FieldSpec::fixed("lr", DType::Uint8, &[3, 8, 8]);
        let mut hr = FieldSpec::fixed("hr", DType::Uint8, &[3, 32, 32]);
        hr.pair = Some(Pairing {
            with: "lr".into(),
            scale: 4,
        });
        assert!(Schema::new(vec![lr.clone(), hr.clone()]).is_ok());
        hr.pair.as_mut().unwrap().scale = 2;
        let err = format!(
            "{:#}",
            Schema::new(vec![lr.clone(), hr.clone()]).unwrap_err()
        );
        assert!(err.contains("sizes disagree"), "{err}");
        hr.pair.as_mut().unwrap().with = "nope".into();
        let err = format!("{:#}", Schema::new(vec![lr, hr]).unwrap_err());
        assert!(err.contains("not a field"), "{err}");
        let label = FieldSpec::fixed("label", DType::Int64, &[]);
        let err = format!("{:#}", Schema::new(vec![label.clone(), label]).unwrap_err());
        assert!(err.contains("declared twice"), "{err}");
    }
}

//! The keys a configuration struct reads, taken from the struct itself: its serde
//! `Deserialize` is run against a deserializer that records the fields each struct asks for
//! and answers every value with a placeholder. `docs/config.md` is checked against these
//! lists, and a dataset's table is split by them into the keys every kind reads and those
//! only its kind does.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// The keys of struct `T`, as a table gives them (renames applied, skipped fields left out).
pub fn keys_of<'de, T: Deserialize<'de>>() -> Vec<&'static str> {
    let mut keys = Vec::new();
    let _ = T::deserialize(Fields { out: &mut keys });
    keys
}

/// Every key path under struct `T`, tables nested within it included ("memory.budget_bytes"),
/// each with `prefix` before it. Arrays of tables (`[[dataset]]`) are named, not entered:
/// list their own struct's keys apart.
pub fn key_paths<'de, T: Deserialize<'de>>(prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let _ = T::deserialize(Tracer {
        path: prefix.trim_end_matches('.').to_string(),
        out: &mut out,
    });
    out
}

/// Records the field list of the first struct asked for, then stops.
struct Fields<'a> {
    out: &'a mut Vec<&'static str>,
}

#[derive(Debug)]
struct Stop(String);

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Stop(msg.to_string())
    }
}

impl<'de> Deserializer<'de> for Fields<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop("not a struct".into()))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        self.out.extend_from_slice(fields);
        Err(Stop("done".into()))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// Walks a struct and the structs within it, recording each field's path.
struct Tracer<'a> {
    path: String,
    out: &'a mut Vec<String>,
}

impl Tracer<'_> {
    fn at(&mut self, key: &str) -> Tracer<'_> {
        let path = if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        };
        Tracer {
            path,
            out: self.out,
        }
    }
}

impl<'de> Deserializer<'de> for Tracer<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_unit()
    }
    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_bool(false)
    }
    fn deserialize_i8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_i8(0)
    }
    fn deserialize_i16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_i16(0)
    }
    fn deserialize_i32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_i32(0)
    }
    fn deserialize_i64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_i64(0)
    }
    fn deserialize_u8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_u8(0)
    }
    fn deserialize_u16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_u16(0)
    }
    fn deserialize_u32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_u32(0)
    }
    fn deserialize_u64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_u64(0)
    }
    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_f32(0.0)
    }
    fn deserialize_f64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_f64(0.0)
    }
    fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_char(' ')
    }
    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_str("")
    }
    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_string(String::new())
    }
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_some(self)
    }
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_seq(Items {
            tracer: self,
            left: 0,
        })
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, Stop> {
        v.visit_seq(Items {
            tracer: self,
            left: len,
        })
    }
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Stop> {
        v.visit_map(Entries {
            tracer: self,
            fields: &[],
        })
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Stop> {
        v.visit_map(Entries {
            tracer: self,
            fields,
        })
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Stop> {
        use serde::de::IntoDeserializer;
        let first: de::value::StrDeserializer<'_, Stop> =
            variants.first().copied().unwrap_or("").into_deserializer();
        v.visit_enum(first)
    }

    serde::forward_to_deserialize_any! {
        i128 u128 bytes byte_buf unit unit_struct newtype_struct tuple_struct identifier
        ignored_any
    }
}

/// A struct's fields, each recorded and its value traced in turn.
struct Entries<'a> {
    tracer: Tracer<'a>,
    fields: &'static [&'static str],
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = Stop;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Stop> {
        use serde::de::IntoDeserializer;
        let Some(&key) = self.fields.first() else {
            return Ok(None);
        };
        let path = self.tracer.at(key).path;
        self.tracer.out.push(path);
        let key: de::value::StrDeserializer<'_, Stop> = key.into_deserializer();
        seed.deserialize(key).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Stop> {
        let key = self.fields[0];
        self.fields = &self.fields[1..];
        seed.deserialize(self.tracer.at(key))
    }
}

/// A fixed-size array's items (all traced at the array's own path).
struct Items<'a> {
    tracer: Tracer<'a>,
    left: usize,
}

impl<'de> de::SeqAccess<'de> for Items<'_> {
    type Error = Stop;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Stop> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        let path = self.tracer.path.clone();
        let before = self.tracer.out.len();
        let value = seed.deserialize(Tracer {
            path,
            out: self.tracer.out,
        })?;
        // An array of numbers names no keys; keep the list free of repeats all the same.
        let mut seen = std::collections::HashSet::new();
        let tail: Vec<String> = self.tracer.out.drain(before..).collect();
        self.tracer
            .out
            .extend(tail.into_iter().filter(|k| seen.insert(k.clone())));
        Ok(Some(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        a: u32,
        #[serde(default)]
        b: Option<[f64; 2]>,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Fast,
        Slow,
    }

    #[derive(Deserialize)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        #[serde(rename = "item")]
        items: Vec<Inner>,
        inner: Inner,
        maybe: Option<Inner>,
        mode: Mode,
        #[serde(skip)]
        hidden: u32,
    }

    #[test]
    fn keys_and_paths_come_from_the_struct() {
        assert_eq!(
            keys_of::<Outer>(),
            ["name", "item", "inner", "maybe", "mode"]
        );
        assert_eq!(
            key_paths::<Outer>("x."),
            [
                "x.name",
                "x.item",
                "x.inner",
                "x.inner.a",
                "x.inner.b",
                "x.maybe",
                "x.maybe.a",
                "x.maybe.b",
                "x.mode"
            ]
        );
    }
}

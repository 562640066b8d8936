// Package body reads the few top-level fields routing needs from an OpenAI-style JSON
// request body and applies top-level edits by splicing bytes, so that everything a
// client sent and we do not edit reaches the engine byte for byte (big integers,
// key order, whitespace, unknown fields). The body is never decoded into a map.
package body

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
)

// Object is a validated JSON object whose top-level members are located by offset.
// It does not copy the body; the caller must not modify it while the Object is used.
type Object struct {
	raw     []byte
	members []member
	open    int // offset just after '{'
	close   int // offset of the final '}'
}

type member struct {
	name     string // decoded key, so "kv\u005ftransfer_params" matches like Python's json does
	start    int    // offset of the key's opening quote
	valStart int
	valEnd   int
}

// ErrNotObject is returned for valid JSON whose top level is not an object.
var ErrNotObject = errors.New("request body must be a JSON object")

// Parse validates b once (JSON syntax, UTF-8, nesting depth) and indexes its members.
func Parse(b []byte) (*Object, error) {
	s := scanner{b: b, members: make([]member, 0, 16)}
	if err := s.scan(); err == errNotUTF8 {
		return nil, err
	} else if err != nil {
		return nil, fmt.Errorf("request body is not valid JSON: %w", err)
	}
	if s.open < 0 {
		return nil, ErrNotObject
	}
	close := len(b) - 1
	for b[close] != '}' {
		close--
	}
	return &Object{raw: b, members: s.members, open: s.open, close: close}, nil
}

// Bytes returns the body the Object was parsed from.
func (o *Object) Bytes() []byte { return o.raw }

// Raw returns the raw JSON value of key. Like Python's json module, which vLLM and
// SGLang use, the last duplicate wins.
func (o *Object) Raw(key string) ([]byte, bool) {
	for i := len(o.members) - 1; i >= 0; i-- {
		if m := o.members[i]; m.name == key {
			return o.raw[m.valStart:m.valEnd], true
		}
	}
	return nil, false
}

// Has reports whether key is present (with any value, null included).
func (o *Object) Has(key string) bool {
	_, ok := o.Raw(key)
	return ok
}

// String returns key's value when it is a JSON string.
func (o *Object) String(key string) (string, bool) {
	raw, ok := o.Raw(key)
	if !ok || raw[0] != '"' {
		return "", false
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1 : len(raw)-1]), true
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// Bool returns key's value when it is a JSON boolean.
func (o *Object) Bool(key string) (value, ok bool) {
	raw, ok := o.Raw(key)
	switch {
	case !ok:
		return false, false
	case string(raw) == "true":
		return true, true
	case string(raw) == "false":
		return false, true
	}
	return false, false
}

// Int returns key's value when it is a JSON integer that fits in an int64.
func (o *Object) Int(key string) (int64, bool) {
	raw, ok := o.Raw(key)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		return 0, false // not the clamped value ParseInt returns on overflow
	}
	return n, true
}

// IsNull reports whether raw is the JSON literal null.
func IsNull(raw []byte) bool { return string(raw) == "null" }

func decodeKey(raw []byte) (string, error) {
	if bytes.IndexByte(raw, '\\') < 0 {
		return string(raw[1 : len(raw)-1]), nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", fmt.Errorf("request body has an invalid key: %w", err)
	}
	return s, nil
}

package scheduling

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// vLLM keeps a stored response (store: true, with
// VLLM_ENABLE_RESPONSES_API_STORE=1) in the memory of the engine process
// that made it: a request naming it elsewhere gets a 404. The response's id
// is its request's request_id, which a client may set. The pipeline sets it
// to NewResponseID of the decode endpoint picked, and the decode pool sends
// a request naming such an id (Request.Response) to the endpoint whose hash
// it carries while that endpoint is a candidate. Every replica reads it
// alike: it is a hash of the address, which the id does not show.

// responseIDPrefix starts the ids NewResponseID makes: vLLM's own are
// "resp_" and 32 hex digits.
const responseIDPrefix = "resp_pd"

// NewResponseID is a new response id naming e: responseIDPrefix, 8 hex
// digits of a hash of e's address and 32 random ones.
func NewResponseID(e *Endpoint) string {
	var b [20]byte
	binary.BigEndian.PutUint32(b[:4], storeHash(e.Addr))
	rand.Read(b[4:])
	return responseIDPrefix + hex.EncodeToString(b[:])
}

// storedOn is the endpoint of eps whose hash the response id carries, nil
// when it carries none or none has it.
func storedOn(id string, eps []*Endpoint) *Endpoint {
	digits, ok := strings.CutPrefix(id, responseIDPrefix)
	if !ok || len(digits) != 40 {
		return nil
	}
	want, err := strconv.ParseUint(digits[:8], 16, 32)
	if err != nil {
		return nil
	}
	for _, e := range eps {
		if storeHash(e.Addr) == uint32(want) {
			return e
		}
	}
	return nil
}

// storeHash is the hash of an endpoint's address that response ids carry.
func storeHash(addr string) uint32 {
	return uint32(xxhash.Sum64String("stored response\x00"+addr) >> 32)
}

// pick is the policy's choice for req among cands, or the one that stores
// the response req names.
func (st *poolState) pick(req *Request, cands []*Endpoint) *Endpoint {
	if req != nil && req.Response != "" {
		if e := storedOn(req.Response, cands); e != nil {
			return e
		}
	}
	return st.picker.Pick(req, cands)
}

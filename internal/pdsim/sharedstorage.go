package pdsim

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// sharedStorage is vLLM's ExampleConnector (formerly SharedStorageConnector):
// nothing in the request, KV saved and loaded under a hash of the prompt.
type sharedStorage struct{ s *Server }

type storedKV struct {
	RequestID    string `json:"request_id"` // X-Request-Id of the prefill that saved it
	Model        string `json:"model"`
	PromptTokens int    `json:"prompt_tokens"`
}

func (st *sharedStorage) firstToken(ctx context.Context, req *request) (kvResult, error) {
	path := filepath.Join(st.s.cfg.SharedDir, req.promptHash+".kv")
	if st.s.cfg.Role == RolePrefill {
		if err := st.s.compute(ctx, req); err != nil {
			return kvResult{}, err
		}
		b, _ := json.Marshal(storedKV{RequestID: req.id, Model: req.model, PromptTokens: req.promptTokens})
		return kvResult{outcome: kvIssued, source: path}, writeAtomically(path, b)
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return kvResult{outcome: kvMiss}, st.s.compute(ctx, req)
	}
	var kv storedKV
	if err == nil {
		err = json.Unmarshal(b, &kv)
	}
	if err != nil {
		return kvResult{}, err
	}
	if err := wait(ctx, st.s.cfg.KVTransfer); err != nil {
		return kvResult{}, err
	}
	return kvResult{outcome: kvHit, source: path, requestID: kv.RequestID}, nil
}

// writeAtomically keeps a concurrent decode from reading half a file.
func writeAtomically(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".pdsim-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
